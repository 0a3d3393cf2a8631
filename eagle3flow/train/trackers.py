"""Experiment trackers the training reports to (``train.report_to``, as in HF's Trainer).

``tensorboard`` writes event files under ``<out_dir>/tensorboard`` (the ``tensorboard``
package, in the environment); ``wandb`` and ``mlflow`` log to the project and server
their own environment variables name (``WANDB_PROJECT``/``WANDB_MODE``,
``MLFLOW_TRACKING_URI``/``MLFLOW_EXPERIMENT_NAME``) when the package is installed. Every
metrics line (loss, per-step loss and accuracy, lr, grad norm, tokens/s, MFU, data wait)
and every evaluation (acceptance length per K: the decode walk and the per-row mean)
goes to each of them, from the main rank only. A tracker that cannot start fails the run at once, before any step.
"""
from __future__ import annotations

from pathlib import Path

TRACKERS = ("tensorboard", "wandb", "mlflow")


def flatten(prefix: str, row: dict) -> dict[str, float]:
    """``{"step_acc": [a, b]}`` -> ``{"train/step_acc/0": a, ...}``: the numbers of a metrics row."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}/{key}"
        if isinstance(value, (list, tuple)):
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
        elif isinstance(value, dict):
            out.update(flatten(name, value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class Trackers:
    def __init__(self, names: list[str], out_dir: Path, run_name: str, config: dict):
        unknown = sorted(set(names) - set(TRACKERS))
        if unknown:
            raise ValueError(f"train.report_to: unknown tracker(s) {unknown}; known: {list(TRACKERS)}")
        self.writers = []
        for name in names:
            try:
                self.writers.append(getattr(self, f"_start_{name}")(out_dir, run_name, config))
            except ImportError as error:
                raise RuntimeError(f"train.report_to lists {name}, but {error.name} is not installed in "
                                   f"this environment (pip install {name})") from error

    @staticmethod
    def _start_tensorboard(out_dir: Path, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        writer.add_text("config", f"run {run_name}: {config}", 0)
        return ("tensorboard", writer)

    @staticmethod
    def _start_wandb(out_dir: Path, run_name: str, config: dict):
        import wandb

        return ("wandb", wandb.init(name=run_name, dir=str(out_dir), config=config, reinit=True))

    @staticmethod
    def _start_mlflow(out_dir: Path, run_name: str, config: dict):
        import mlflow

        run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})
        return ("mlflow", run)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for kind, writer in self.writers:
            if kind == "tensorboard":
                for name, value in scalars.items():
                    writer.add_scalar(name, value, step)
                writer.flush()
            elif kind == "wandb":
                writer.log(scalars, step=step)
            else:
                import mlflow

                mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        for kind, writer in self.writers:
            if kind == "tensorboard":
                writer.close()
            elif kind == "wandb":
                writer.finish()
            else:
                import mlflow

                mlflow.end_run()
        self.writers = []
