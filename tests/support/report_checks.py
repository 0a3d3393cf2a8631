"""Checks of a `snakemake --report` HTML file, rendered for real in headless Chromium.

The report is a single-page app: its results (figures, tables) are embedded as data
URIs in a ``results`` script variable and shown one at a time on click. To check all
of them at once, a copy of the report gets one extra script that, once the app has
loaded, decodes every embedded image in Chromium, draws it on a canvas and records its
size and how many distinct colours it has (a blank figure has one or two), and records
whether the app itself rendered (its navigation). ``--dump-dom`` then hands back the
page with those records.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage"]

PROBE = """
<script>
window.addEventListener("load", async () => {
  // React renders after load: give it (virtual) time before looking.
  await new Promise(ok => setTimeout(ok, 2000));
  const app = document.getElementById("app");
  const probe = {app: app ? app.querySelectorAll("*").length : -1,
                 app_text: app ? app.textContent.slice(0, 2000) : "",
                 jswarning_hidden: !document.getElementById("jswarning") ||
                                   document.getElementById("jswarning").offsetParent === null,
                 images: {}};
  for (const [path, r] of Object.entries(results)) {
    if (!r.mime_type.startsWith("image/")) continue;
    const img = new Image();
    const loaded = new Promise(ok => { img.onload = () => ok(true); img.onerror = () => ok(false); });
    img.src = r.data_uri;
    const ok = await loaded;
    const info = {ok: ok, width: img.naturalWidth, height: img.naturalHeight, colors: 0};
    if (ok && img.naturalWidth > 0) {
      const canvas = document.createElement("canvas");
      canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
      const ctx = canvas.getContext("2d");
      ctx.drawImage(img, 0, 0);
      const data = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
      const seen = new Set();
      for (let i = 0; i < data.length && seen.size < 5000; i += 4 * 7) {
        seen.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]);
      }
      info.colors = seen.size;
    }
    probe.images[path] = info;
  }
  const out = document.createElement("pre");
  out.id = "report-probe";
  out.textContent = JSON.stringify(probe);
  document.body.appendChild(out);
});
</script>
"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise RuntimeError("chromium not found; run scripts/install_test_deps.sh (make test does)")
    return path


def embedded_results(report_html: Path) -> dict:
    """The report's ``results`` variable: {path: {name, mime_type, caption, data_uri, ...}}."""
    text = Path(report_html).read_text()
    match = re.search(r'<script id="results">\s*var results = (.*?);\s*</script>', text, re.S)
    assert match, f"{report_html}: no embedded results (is it a Snakemake report?)"
    return json.loads(match.group(1))


def decode_data_uri(uri: str) -> bytes:
    assert uri.startswith("data:"), uri[:60]
    return base64.b64decode(uri.split("base64,", 1)[1])


def render_in_chromium(report_html: Path, tmp_dir: Path, timeout: float = 120) -> dict:
    """Load the report in headless Chromium with the probe; return the probe's record."""
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    probed = tmp_dir / "report_probed.html"
    text = Path(report_html).read_text()
    # Before the last </body>: scripts embedded in the report contain that string too.
    head, sep, tail = text.rpartition("</body>")
    probed.write_text(head + PROBE + sep + tail if sep else text + PROBE)
    cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_dir / 'chromium-profile'}",
           "--virtual-time-budget=20000", "--dump-dom", probed.resolve().as_uri()]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    match = re.search(r'<pre id="report-probe">(.*?)</pre>', result.stdout, re.S)
    assert match, f"Chromium gave no probe (rc {result.returncode}): {result.stderr[-2000:]}"
    import html
    return json.loads(html.unescape(match.group(1)))


def screenshot(report_html: Path, tmp_dir: Path, timeout: float = 120) -> Path:
    """A PNG of the report's landing page as Chromium draws it."""
    out = Path(tmp_dir) / "report.png"
    subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={Path(tmp_dir) / 'chromium-shot'}",
                    "--virtual-time-budget=20000", "--window-size=1280,900",
                    f"--screenshot={out}", Path(report_html).resolve().as_uri()],
                   capture_output=True, timeout=timeout, check=True)
    return out


def check_report(report_html: Path, tmp_dir: Path, figures: list[str], pages: dict[str, list[str]]) -> dict:
    """Assert the report is one self-contained file whose figures Chromium decodes as real,
    non-blank images, and whose HTML pages hold the given texts. Returns the probe.

    ``figures``: file names of PNGs that must be embedded; ``pages``: {html file name:
    [texts it must contain]}.
    """
    report_html = Path(report_html)
    text = report_html.read_text()
    # Self-contained: nothing fetched from elsewhere (links to snakemake.github.io etc. in
    # anchors are fine; scripts, styles and images are not).
    assert not re.search(r'<(script|img|link)[^>]+(src|href)="https?://', text), \
        "the report loads something from the network"
    results = embedded_results(report_html)
    by_name = {Path(p).name: r for p, r in results.items()}
    for name in figures:
        assert name in by_name, f"{name} not in the report: {sorted(by_name)}"
        data = decode_data_uri(by_name[name]["data_uri"])
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, (name, len(data))
        assert by_name[name]["caption"].strip(), f"{name} has no caption"
    for name, needles in pages.items():
        assert name in by_name, f"{name} not in the report: {sorted(by_name)}"
        page = decode_data_uri(by_name[name]["data_uri"]).decode()
        for needle in needles:
            assert needle in page, f"{name} lacks {needle!r}"

    probe = render_in_chromium(report_html, tmp_dir)
    assert probe["app"] > 10 and probe["jswarning_hidden"], probe  # the app ran
    for path, info in probe["images"].items():
        if Path(path).name in figures:
            assert info["ok"] and info["width"] >= 300 and info["height"] >= 200, (path, info)
            assert info["colors"] >= 10, f"{path} looks blank: {info}"
    assert {Path(p).name for p in probe["images"]} >= set(figures), probe["images"].keys()

    shot = screenshot(report_html, tmp_dir)
    assert shot.stat().st_size > 10_000, "the report's landing page renders empty"
    return probe


EMBEDDED_FIGURES = ["training.png", "throughput.png", "vocab_coverage.png",
                    "acceptance_per_position.png", "acceptance_vs_k.png"]


def check_embedded_report(workdir: Path, tmp_dir: Path, snakemake_bin: Path, env: dict | None = None,
                          timeout: float = 600, args: tuple[str, ...] = ("--profile", "embedded")) -> dict:
    """`snakemake --report report.html --profile embedded` (or ``args``: the run's own) in a
    finished embedded run's workdir, then :func:`check_report` on it with every figure of
    the report stage."""
    result = subprocess.run([str(snakemake_bin), "--report", "report.html", *args],
                            cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return check_report(Path(workdir) / "report.html", tmp_dir, figures=EMBEDDED_FIGURES,
                        pages={"evaluation.html": ['id="drafts"', 'data-set="eval" data-draft="draft"',
                                                   'id="acceptance-vs-k"'],
                               "run.html": ["no service drained", 'id="dataset-splits"', 'id="config"']})
