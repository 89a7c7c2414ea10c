"""Model building blocks shared by the model families: one concept a file."""
