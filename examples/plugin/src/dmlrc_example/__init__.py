"""An example dml-reality-check plugin: Circle loss (not in the zoo) and a small trunk."""
