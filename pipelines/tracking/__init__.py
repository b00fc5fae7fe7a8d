"""MLflow: runs and their tree, outages of the tracking server, the model registry and the pyfunc model."""
