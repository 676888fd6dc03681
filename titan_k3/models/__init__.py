"""Model families. Importing this package imports no torch."""
