"""Regenerate the docs' pictures (README.md, docs/operations.md) from a real training run of the built-in environment.

    python -m pip install cairosvg      # only for the panel's SVG -> PNG conversion
    python docs/make_screenshots.py     # ~2 min on 2 CPU cores

Writes docs/img/: the ``gradmon-ray watch`` panel (rich's SVG export converted to PNG, plus the
plain-text frame, and the frame at 80 columns: the compact table with abbreviated head names), the
plots and the report's summary.md, all from one run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.viz.panel import watch
from gradmon_ray.viz.report import write_report

OUT = Path(__file__).resolve().parent / "img"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=16)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict(
            {
                "iterations": args.iterations,
                "seed": 0,
                "vgs": {"enabled": True},
                "probe": {"gradient_analysis_every": 4},
                "regularizers": [{"name": "logit_l2", "weight": 0.001}],
                "mlflow": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "screenshots"},
            }
        )
        outcome = run_training(cfg)
        client = MlflowClient(cfg.mlflow.tracking_uri)
        console = Console(record=True, width=150, color_system="truecolor", force_terminal=True)
        watch(client, run_id=outcome.run_id, once=True, console=console)
        (OUT / "watch_panel.txt").write_text(console.export_text(clear=False))
        narrow = Console(record=True, width=80, color_system=None, force_terminal=False)
        watch(client, run_id=outcome.run_id, once=True, console=narrow)
        (OUT / "watch_panel_80.txt").write_text(narrow.export_text())
        svg = console.export_svg(title="gradmon-ray watch --once")
        # Rich's SVG asks for Fira Code; render with DejaVu Sans Mono, which every matplotlib
        # install has and whose box-drawing and arrow glyphs share one cell width.
        svg = svg.replace('"Fira Code"', '"DejaVu Sans Mono"').replace("Fira Code, monospace", "DejaVu Sans Mono")
        (OUT / "watch_panel.svg").write_text(svg)
        import cairosvg  # docs-only dependency

        cairosvg.svg2png(bytestring=svg.encode(), write_to=str(OUT / "watch_panel.png"), output_width=1400)
        for path in write_report(client, outcome.run_id, OUT):
            print("wrote", path)
    print("wrote", OUT / "watch_panel.png")


if __name__ == "__main__":
    main()
