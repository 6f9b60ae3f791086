"""Using a trained model: load and predict, export, the model registry, serving and A/B tests."""
