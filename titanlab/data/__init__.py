"""The data pipeline: tokenizers, data preparation (`prepare`, `prepare_chat`), memmap token
datasets, chat SFT packing, mixtures, the stateful loader, and the segment ids of document
masking (`segments`; the model builds the mask from them).

May import `config` only: data knows nothing of the model.
"""
