"""Tables and figures from MLflow alone."""
