"""``vatra predict`` and ``vatra export``: score a file with a trained model, or write the model out."""

from __future__ import annotations

from pathlib import Path

import typer

from vatra.cli.app import app


@app.command()
def predict(
    run: Path = typer.Argument(..., help="Run folder (runs/<run-id>) or exported model folder."),
    data: Path = typer.Option(
        ..., "--data", help="Rows to score: a CSV or Parquet file, or a Delta table folder."
    ),
    out: Path = typer.Option(..., "--out", help="Parquet file to write the predictions to."),
    keep: list[str] = typer.Option(
        [], "--keep", help="An input column to copy into the output, e.g. an id (repeat for several)."
    ),
    version: str | None = typer.Option(
        None, "--version", help="Checkpoint version, tag or unique prefix of the run (default: latest)."
    ),
    batch_rows: int = typer.Option(65_536, "--batch-rows", help="Rows read and scored at a time."),
    unseen: str = typer.Option(
        "error", "--unseen", help="A category not seen in training: error, or zero (scored as unknown)."
    ),
) -> None:
    """Score the rows of a file with a trained model, in batches (files larger than memory), into a
    Parquet file: one row per input row, in input order, with a prediction column and, for
    classification, a proba_CLASS column per class."""
    from vatra.serve import load
    from vatra.serve.stream import predict_file

    predictor = load(run, version)
    result = predict_file(predictor, data, out, keep=keep, batch_rows=batch_rows, unseen=unseen)
    print(
        f"vatra: {result['rows']} rows scored into {out} in {result['seconds']:.2f} s "
        f"({result['rows_per_s']:,.0f} rows/s)"
    )


@app.command()
def export(
    run: Path = typer.Argument(..., help="Run folder (runs/<run-id>)."),
    out: Path = typer.Option(..., "--out", help="Model folder to write (new or empty)."),
    format: str = typer.Option(
        "safetensors",
        "--format",
        help="Weights format: safetensors, torchscript, pt2 (torch.export) or onnx.",
    ),
    version: str | None = typer.Option(
        None, "--version", help="Checkpoint version, tag or unique prefix (default: latest)."
    ),
) -> None:
    """Write the run's model as a self-contained folder (weights, preprocessing, signature, lineage)
    that vatra.load reads without the run folder; the exported model is checked against the
    PyTorch model on the run's validation rows."""
    import json

    from vatra.serve import export_run
    from vatra.serve.folder import MANIFEST

    folder = export_run(run, out, format, version)
    check = json.loads((folder / MANIFEST).read_text()).get("check")
    if check:
        print(
            f"vatra: {format} model written to {folder}; max abs difference from the PyTorch model on "
            f"{check['rows']} validation rows: {check['max_abs_diff']:.3g}"
        )
    else:
        print(f"vatra: {format} model written to {folder} (the run's data is gone: not checked)")
