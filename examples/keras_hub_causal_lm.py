"""A small Llama-shaped causal language model from keras-hub, trained on token ids:
`meshfit train examples/keras_hub_causal_lm.py --simulate-devices 8 --model-parallel 2`.

The model is keras-hub's LlamaBackbone built from a small random configuration (no weights are
downloaded) with its tied output head; the data are token sequences (here a synthetic stream in
which each token follows from the one before, so the loss can fall) with next-token labels.
Put your own tokenized text in `dataset()`: arrays of token ids, (sequences, length + 1).
Needs `pip install 'meshfit[hub]'`.
"""

import numpy as np

import meshfit

VOCAB, LENGTH = 512, 64


def token_sequences(count, seed):
    """Token ids (count, LENGTH + 1): each token is the one before plus 1 to 3 (mod VOCAB)."""
    rng = np.random.default_rng(seed)
    steps = np.concatenate([rng.integers(0, VOCAB, (count, 1)), rng.integers(1, 4, (count, LENGTH))], axis=1)
    return (np.cumsum(steps, axis=1) % VOCAB).astype("int32")


def dataset(seed):
    """Streamed sources of (x, y) batches: x token ids (64, LENGTH), y the next token at every
    position. Replace token_sequences with your own tokenized text."""
    import keras

    class Batches(keras.utils.PyDataset):
        def __init__(self, tokens, batch=64):
            super().__init__()
            self.tokens, self.batch = tokens, batch

        def __len__(self):
            return len(self.tokens) // self.batch

        def __getitem__(self, i):
            rows = self.tokens[i * self.batch:(i + 1) * self.batch]
            return rows[:, :-1], rows[:, 1:]

    return {"train": Batches(token_sequences(4096, seed)), "validation": None,
            "test": Batches(token_sequences(512, seed + 1)),
            "class_names": [str(token) for token in range(VOCAB)]}


def build_model(input_shape, num_classes):
    """Token ids (batch, LENGTH) in, next-token logits (batch, LENGTH, VOCAB) out."""
    import keras
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=64, intermediate_dim=256)
    token_ids = keras.Input(input_shape, dtype="int32", name="token_ids")
    hidden = backbone({"token_ids": token_ids, "padding_mask": keras.ops.ones_like(token_ids)})
    logits = backbone.token_embedding(hidden, reverse=True)
    return keras.Model(token_ids, logits)


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.AdamW(keras.optimizers.schedules.CosineDecay(
        0.0, steps_per_epoch * epochs, warmup_target=3e-3, warmup_steps=steps_per_epoch // 2))


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


RECIPE = meshfit.Recipe(name="keras-hub-causal-lm", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, loss=loss, epochs=2, input_shape=(LENGTH,), doc="a small Llama causal LM from keras-hub on token ids")
