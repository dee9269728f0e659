"""keras-hub language models on 8 simulated devices, as their users write them: plain `generate`
and `fit` after `meshfit.connect()`, compared with one device. Models are small random
configurations (no weights are downloaded): a Gemma-shaped and a Llama-shaped causal LM fed token
ids directly (preprocessor=None)."""

import dataclasses

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402 (conftest chose the backend)

from helpers import connect_eight_devices  # noqa: E402
from meshfit.fit.strategy import Strategy  # noqa: E402

VOCAB, SEQ = 256, 12


def one_device(strategy):
    """The first of the 8 simulated devices alone, as a Strategy."""
    return Strategy(dataclasses.replace(strategy.info, devices=strategy.info.devices[:1], devices_per_host=1),
                    "jax", "float32")


def gemma(seed=0):
    """A 2-layer Gemma causal LM (hidden 32, 4 query heads, 1 key/value head), greedy sampler."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=1, hidden_dim=32, intermediate_dim=128,
                                              head_dim=8)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(sampler="greedy")
    return model


def prompts(n, seed=0):
    """n prompts of 4 tokens padded to SEQ, as keras-hub's generate takes them without a preprocessor."""
    ids = np.random.default_rng(seed).integers(1, VOCAB, (n, SEQ)).astype("int32")
    mask = np.zeros((n, SEQ), bool)
    mask[:, :4] = True
    ids[~mask] = 0
    return {"token_ids": ids, "padding_mask": mask}


@pytest.fixture(scope="module")
def one_device_gemma():
    """The tiny Gemma's weights and its tokens on one device for 1, 3 and 8 prompts."""
    one = one_device(connect_eight_devices())
    try:
        with one.scope():
            model = gemma()
            tokens = {n: model.generate(prompts(n), stop_token_ids=None)["token_ids"] for n in (1, 3, 8)}
        return model.get_weights(), tokens
    finally:
        connect_eight_devices()


def test_generate_on_any_number_of_prompts_matches_one_device(strategy, one_device_gemma):
    # keras-hub places prompts itself (distribute_tensor with the data layout): 1 and 3 prompts do
    # not split over 8 devices and once failed with JAX's IndivisibleError.
    weights, expected = one_device_gemma
    model = gemma(seed=1)
    model.set_weights(weights)
    for n in (1, 3, 8):
        np.testing.assert_array_equal(model.generate(prompts(n), stop_token_ids=None)["token_ids"],
                                      expected[n])
    placed = keras.distribution.distribute_tensor(np.ones((3, 4), "float32"),
                                                  strategy.distribution.get_data_layout((3, 4)))
    assert placed.sharding.is_fully_replicated and placed.shape == (3, 4)
