"""The target's tokenizer, loaded the one way every stage loads it: from the local
directory only, its own code run only when ``target.trust_remote_code`` allows it."""
from __future__ import annotations

from pathlib import Path

from eagle3flow.target.remote_code import check_remote_code, is_transformers_refusal, refusal


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The target's fast tokenizer (local directory only, never downloads); its own code
    runs only with ``trust_remote_code`` (``target.trust_remote_code``)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
    check_remote_code(path, trust_remote_code)
    try:
        # False, never transformers' default None: that asks on stdin, which a job has not.
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=bool(trust_remote_code))
    except (OSError, ValueError) as error:
        if is_transformers_refusal(error):
            raise refusal(path, {}, str(error).splitlines()[0]) from error
        raise ValueError(f"cannot load a tokenizer from {str(path)!r} (needs tokenizer.json and "
                         f"tokenizer_config.json): {error}") from error
