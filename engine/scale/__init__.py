"""Several engines: worker processes and Ray actors."""
