"""Parameter-efficient fine-tuning applied from outside the model (module swaps on the meta
model before `parallelize`)."""
