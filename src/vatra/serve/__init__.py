"""Using a trained model: load and predict, export, the model registry, serving and A/B tests.

``load`` rebuilds a run's (or an exported model folder's) model with its preprocessing and output
decoding as a :class:`Predictor`; ``export_run`` writes a self-contained model folder.
"""

from __future__ import annotations

from vatra.serve.export import FORMATS, export_run
from vatra.serve.loader import load
from vatra.serve.predict import Predictor
from vatra.serve.signature import InputError

__all__ = ["FORMATS", "InputError", "Predictor", "export_run", "load"]
