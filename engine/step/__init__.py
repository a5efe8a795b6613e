"""One model step: the model runner, its index arrays, decode graphs and the decode pipeline, sequences."""
