"""The ledger: one training step at its real shape, op by op, priced for the GPU it is meant
for, without the GPU (`titanlab ledger CONFIG --device h100`). `record` records the ops,
`price` prices them on a cluster profile's roofline, `step` runs the trainer's step to record,
`report` summarizes."""
