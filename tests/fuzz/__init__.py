"""Coverage-guided fuzz targets (atheris) for every decoder of outside input; see ``targets.TARGETS``."""
