"""What a run records: the MLflow run and its metric writer, the ledger, outputs, plots, redaction, sweeps."""
