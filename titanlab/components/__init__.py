"""The reusable parts a training run is built from: the component builders (model on the
meta device, tokenizer, batch split, weight init: `builders`), the loss (`loss`), optimizers
and LR schedules (`optim`).

May import `config`, `models`, `precision`, `peft`, `distributed`, `data` and `checkpoint`.
"""
