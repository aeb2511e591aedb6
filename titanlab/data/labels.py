"""The label convention shared by the data pipeline and the losses."""

# Label of a position the loss skips (PyTorch's `F.cross_entropy` default `ignore_index`): the
# prompt of a chat sample, padding, a target across documents.
IGNORE_INDEX = -100
