"""keras-hub language models on 8 simulated devices, as their users write them: plain `generate`
and `fit` after `meshfit.connect()`, compared with one device. Models are small random
configurations (no weights are downloaded): a Gemma-shaped and a Llama-shaped causal LM fed token
ids directly (preprocessor=None), and a Gemma fine-tuned with LoRA on strings through its
preprocessor, on a SentencePiece vocabulary trained here."""

import dataclasses

import numpy as np
import meshfit
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402 (conftest chose the backend)

from helpers import connect_eight_devices  # noqa: E402
from meshfit.fit.strategy import Strategy  # noqa: E402
from meshfit.parallel import modes  # noqa: E402

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


def llama(seed=0, lora=False):
    """A 2-layer Llama causal LM (hidden 32, 4 query and 2 key/value heads, MLP 128), Adam;
    lora: with LoRA adapters of rank 4, the only variables trained."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=32, intermediate_dim=128)
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(rank=4)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


TOKENS = np.random.default_rng(1).integers(1, VOCAB, (32, SEQ + 1)).astype("int32")


def train(model):
    """Plain keras-hub `fit`: 2 steps of 16 sequences (next-token labels); the losses."""
    x = {"token_ids": TOKENS[:, :-1], "padding_mask": np.ones((32, SEQ), bool)}
    return model.fit(x, TOKENS[:, 1:], batch_size=16, epochs=1, verbose=0).history["loss"]


@pytest.fixture(scope="module")
def one_device_losses():
    """Losses of 2 steps on one device: the Llama trained whole, and with LoRA."""
    one = one_device(connect_eight_devices())
    try:
        with one.scope():
            return train(llama()), train(llama(lora=True))
    finally:
        connect_eight_devices()


@pytest.fixture
def one_device_loss(one_device_losses):
    return one_device_losses[0]


def device_zero_share(model) -> float:
    """The share of the weights and optimizer state (bytes) device 0 holds."""
    variables = list(model.variables) + list(model.optimizer.variables)
    held = sum(s.data.nbytes for v in variables for s in v.value.addressable_shards
               if s.device == v.value.sharding.mesh.devices.flat[0])
    return held / sum(v.value.nbytes for v in variables)


def replicated_bytes(model) -> int:
    """Bytes of the model's variables held whole on every device."""
    return sum(v.value.nbytes for v in model.variables if not any(v.value.sharding.spec))


def test_auto_shards_a_model_that_does_not_fit_at_its_first_fit(one_device_loss, capsys):
    # 680 KB per device replicated, 490 KB under fsdp (the plan printed below says so): auto in
    # Python plans at the first fit with fit's own batch (a sequence length keras.Input leaves
    # unknown) and lays the variables out as fsdp before the first step. Before it, the
    # variables past a quarter of the device memory were created sharded.
    strategy = meshfit.connect(simulate_devices=8, verbose=False, sharding="auto",
                               device_memory="600KB", fsdp_min_bytes="1KB")
    try:
        model = llama()
        whole = sum(v.value.nbytes for v in model.variables)
        assert strategy.sharding is modes.DATA
        assert replicated_bytes(model) <= strategy.distribution.spill_after < whole
        losses = train(model)
        out = capsys.readouterr().out
        assert "using fsdp: the replicated step needs" in out and "more than 600.0 KB" in out
        assert strategy.sharding is modes.FSDP
        np.testing.assert_allclose(losses, one_device_loss, rtol=1e-5)
        assert device_zero_share(model) < 0.2  # 1/8 of the sharded variables, small ones whole
    finally:
        connect_eight_devices()


def test_auto_gathers_a_lora_model_built_sharded_when_its_replicated_step_fits(one_device_losses, capsys):
    # The LoRA Llama's frozen weights (196 KB) pass a quarter of 600 KB, so its last kernels are
    # created sharded; its replicated step (460 KB: few weights train) fits, so the first fit
    # gathers them and trains data-parallel, as one device does.
    strategy = meshfit.connect(simulate_devices=8, verbose=False, sharding="auto",
                               device_memory="600KB", fsdp_min_bytes="1KB")
    try:
        model = llama(lora=True)
        frozen = {v.path: np.array(v.value) for v in model.non_trainable_variables}
        whole = sum(v.value.nbytes for v in model.variables)
        assert replicated_bytes(model) < whole  # some created sharded
        losses = train(model)
        assert capsys.readouterr().out == ""  # the replicated step fits: nothing to say
        assert strategy.sharding is modes.DATA and replicated_bytes(model) == whole
        np.testing.assert_allclose(losses, one_device_losses[1], rtol=1e-5)
        assert all(np.array_equal(frozen[v.path], v.value) for v in model.non_trainable_variables)
    finally:
        connect_eight_devices()


def test_plan_takes_the_sequence_length_keras_input_leaves_unknown(strategy, capsys):
    from meshfit.fit import memory_plan

    with strategy.scope():
        model = llama()
    with pytest.raises(meshfit.MeshfitError, match="input_shapes="):
        memory_plan.plan_memory(model, strategy, 16, None)
    short, long = (memory_plan.plan_mode(model, strategy, "data", 16, 10 ** 9,
                                         input_shapes={"token_ids": (n,), "padding_mask": (n,)})
                   for n in (16, 256))
    assert short.fits and short.batch == 2 * 16 * (4 + 4)  # 2 rows per device of 16 int32 ids and mask
    assert long.step_temp > 4 * short.step_temp
    # meshfit.plan builds the model without giving its variables values: the same plan.
    built = []
    abstract = meshfit.plan(lambda: built.append(llama()) or built[0], 16,
                            input_shapes={"token_ids": (16,), "padding_mask": (16,)})
    assert abstract.modes["data"].total == short.total
    assert "using data: device memory unknown" in capsys.readouterr().out
    assert all(v._value is None for v in built[0].variables)  # nothing allocated


def test_model_parallel_pairs_kernels_as_megatron_and_trains_as_one_device(one_device_loss):
    strategy = meshfit.connect(simulate_devices=8, verbose=False, sharding="fsdp",
                               model_parallel=2, fsdp_min_bytes=1)
    try:
        assert strategy.distribution.axis_sizes == {"batch": 4, "model": 2} and strategy.replicas == 4
        model = llama()
        specs = {v.path.replace("transformer_layer_0/", ""): tuple(v.value.sharding.spec) + (None,) * (len(v.shape) - len(v.value.sharding.spec))
                 for v in model.variables if "transformer_layer_0" in v.path or "embedding" in v.path}
        model_axis = {path: spec.index("model") if "model" in spec else None for path, spec in specs.items()}
        # Heads of query/key/value (hidden, heads, head_dim) and of the output (heads, head_dim,
        # hidden); MLP up-projections on their output, the down-projection on its input.
        assert model_axis["self_attention/query/kernel"] == 1
        assert model_axis["self_attention/key/kernel"] == 1
        assert model_axis["self_attention/attention_output/kernel"] == 0
        assert model_axis["feedforward_intermediate_dense/kernel"] == 1
        assert model_axis["feedforward_gate_dense/kernel"] == 1
        assert model_axis["feedforward_output_dense/kernel"] == 0
        assert model_axis["token_embedding/embeddings"] == 0  # vocabulary x hidden: the vocabulary
        assert all("batch" in spec for path, spec in specs.items() if path.endswith("kernel"))
        np.testing.assert_allclose(train(model), one_device_loss, rtol=1e-5)
        assert device_zero_share(model) <= 1.05 / 8
    finally:
        connect_eight_devices()


def test_fsdp_x_model_4_holds_an_eighth_where_the_key_value_heads_do_not_split(one_device_loss):
    # 2 key/value heads do not split over 4: their kernels, like the norms' scales, go over both
    # axes (all 8 devices), so device 0 still holds an eighth of the state; losses as one device.
    meshfit.connect(simulate_devices=8, verbose=False, sharding="fsdp", model_parallel=4,
                    fsdp_min_bytes=1)
    try:
        model = llama()
        key = next(v for v in model.variables if v.path.endswith("self_attention/key/kernel"))
        assert tuple(key.value.sharding.spec)[0] == ("batch", "model")
        np.testing.assert_allclose(train(model), one_device_loss, rtol=1e-5)
        assert device_zero_share(model) <= 1.05 / 8
    finally:
        connect_eight_devices()


def test_a_keras_hub_layout_map_is_used_as_written():
    strategy = meshfit.connect(simulate_devices=8, verbose=False, sharding="data", model_parallel=2)
    try:
        with strategy.scope():
            assert tuple(gemma().backbone.get_layer("token_embedding").embeddings.value.sharding.spec) == (
                "model", None)  # the rule, before the map
        strategy.layout_map = keras_hub.models.GemmaBackbone.get_layout_map(strategy.device_mesh)
        with strategy.scope():
            model = gemma()
        embeddings = model.backbone.get_layer("token_embedding").embeddings
        assert tuple(embeddings.value.sharding.spec) == ("model", "batch")
        # A map made for a mesh of another shape is taken onto meshfit's; an axis it lacks: one warning.
        other = keras.distribution.DeviceMesh((1, 8), ("data", "model"), keras.distribution.list_devices())
        lacking = keras.distribution.LayoutMap(other)
        lacking[".*embeddings"] = ("model", "data")
        with pytest.warns(UserWarning, match="1 entry .* name an axis this mesh lacks"):
            strategy.layout_map = lacking
        # The function itself, given to connect(), is called with meshfit's mesh. (Under fsdp x
        # model meshfit's rule lays every Gemma kernel out as this map does; under data it
        # would leave 'batch' out, so 'batch' here is the map's.)
        meshfit.connect(simulate_devices=8, verbose=False, sharding="data", model_parallel=2,
                        layout_map=keras_hub.models.GemmaBackbone.get_layout_map)
        model = gemma()
        assert tuple(model.backbone.get_layer("token_embedding").embeddings.value.sharding.spec) == (
            "model", "batch")
    finally:
        connect_eight_devices()


def test_model_parallel_must_divide_the_devices(strategy):
    from meshfit.run.options import TrainOptions

    with pytest.raises(meshfit.MeshfitError, match="model_parallel=3 does not divide the 8 devices"):
        meshfit.connect(simulate_devices=8, verbose=False, model_parallel=3)
    with pytest.raises(meshfit.MeshfitError, match="--model-parallel 0 is not a whole number"):
        TrainOptions(model_parallel=0)
    try:
        mesh = meshfit.connect(simulate_devices=8, verbose=False, model_parallel=8)
        assert mesh.replicas == 1 and "1, each on 8 devices" in mesh.report()
    finally:
        connect_eight_devices()


def test_lora_under_fsdp_and_model_parallelism_trains_its_adapters_as_one_device(one_device_losses):
    meshfit.connect(simulate_devices=8, verbose=False, sharding="fsdp", model_parallel=2,
                    fsdp_min_bytes=1)
    try:
        model = llama(lora=True)
        assert model.trainable_variables and all("lora_kernel" in v.path for v in model.trainable_variables)
        frozen = [np.array(v.value) for v in model.non_trainable_variables]
        np.testing.assert_allclose(train(model), one_device_losses[1], rtol=1e-5)
        assert all(np.array_equal(a, np.array(v.value)) for a, v in zip(frozen, model.non_trainable_variables))
    finally:
        connect_eight_devices()


def vit(seed=0):
    """A 1-layer keras-hub ViT classifier (16 x 16 images, 4 x 4 patches, hidden 32, 4 heads), SGD."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.ViTBackbone(image_shape=(16, 16, 3), patch_size=4, num_layers=1,
                                            num_heads=4, hidden_dim=32, mlp_dim=128)
    model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10, preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_vit_under_fsdp_x_model_takes_one_device_step(strategy):
    # With its window (4 x 4) split by fsdp, XLA computed twice the patch-embedding kernel's
    # gradient (benchmarks/xla_conv_window_gradient.py); Adam hid it (3.9e-5 in the loss), SGD
    # shows it. The rule splits a convolution kernel along its channels only.
    images = np.random.default_rng(0).normal(size=(16, 16, 16, 3)).astype("float32")
    labels = np.arange(16) % 10

    def step(model):
        model.fit(images, labels, batch_size=16, epochs=1, verbose=0)
        return [np.array(v.value) for v in model.trainable_variables]

    with one_device(strategy).scope():
        expected = step(vit())
    meshfit.connect(simulate_devices=8, verbose=False, sharding="fsdp", model_parallel=2, fsdp_min_bytes=1)
    try:
        model = vit()
        kernel = model.backbone.get_layer("vit_patching_and_embedding").patch_embedding.kernel
        assert tuple(kernel.value.sharding.spec) == (None, None, None, ("model", "batch"))
        for variable, got, want in zip(model.trainable_variables, step(model), expected):
            np.testing.assert_allclose(got, want, atol=2e-6, err_msg=variable.path)
    finally:
        connect_eight_devices()


INSTRUCTIONS = ["Instruction:\nWhat is a cat?\n\nResponse:\nA cat is a small animal.",
                "Instruction:\nWhat is a dog?\n\nResponse:\nA dog is a loyal animal.",
                "Instruction:\nName a colour.\n\nResponse:\nRed is a colour."] * 4


def gemma_on_strings(strategy):
    """keras.io's Gemma LoRA guide on a tiny random Gemma: a SentencePiece vocabulary trained on
    the texts (no download), GemmaCausalLM with its preprocessor, LoRA, AdamW without decay on
    biases and scales, greedy sampling; fit on the strings, 3 a batch (not a multiple of 8), then
    generate from a string. Returns (losses, generated text)."""
    import io

    import sentencepiece

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(INSTRUCTIONS * 20), model_writer=proto, vocab_size=24, model_type="WORD",
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="<pad>", bos_piece="<bos>",
        eos_piece="<eos>", unk_piece="<unk>", user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        minloglevel=2)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        tokenizer = keras_hub.models.GemmaTokenizer(proto=proto.getvalue())
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_query_heads=4,
            num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8)
        model = keras_hub.models.GemmaCausalLM(
            backbone=backbone,
            preprocessor=keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=24))
        backbone.enable_lora(rank=4)
        optimizer = keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=0.01)
        optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
        model.compile(optimizer=optimizer, sampler="greedy",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
    losses = model.fit(INSTRUCTIONS, batch_size=3, epochs=2, verbose=0).history["loss"]
    return losses, model.generate("Instruction:\nWhat is a cat?\n\nResponse:\n", max_length=20)


def test_gemma_fine_tuned_with_lora_on_strings_trains_and_generates_as_one_device(strategy, caplog):
    """The path most users take: strings through keras-hub's preprocessor (a grain pipeline keras-hub
    builds), on 8 devices under fsdp x model 2 and data, as on one; without grain's warning on
    keras-hub's read-ahead at each call (meshfit.fit.library_logs)."""
    one = one_device(strategy)
    try:
        with one.scope():  # fit too: the 8 devices' strategy is the one connected
            expected_losses, expected_text = gemma_on_strings(one)
    finally:
        connect_eight_devices()
    for mode in (dict(sharding="fsdp", model_parallel=2), dict(sharding="data")):
        strategy = meshfit.connect(simulate_devices=8, engine="jax", verbose=False, **mode)
        losses, text = gemma_on_strings(strategy)
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        assert text == expected_text and text.startswith("Instruction:")
    connect_eight_devices()
    assert not [r for r in caplog.records if "prefetch_buffer_size" in r.getMessage()]


def test_only_keras_hubs_read_ahead_warning_of_grain_is_dropped(strategy, caplog):
    """keras-hub 0.32's ReadOptions(prefetch_buffer_size=8) beside grain's 16 threads warned at every
    call on strings; a user's own ReadOptions still warns. The record as grain 0.2.18 logs it
    (grain/_src/python/options.py), so that this runs where grain is not installed (keras-hub
    then reads strings through tf.data, and nothing warns)."""
    import logging

    message = ("prefetch_buffer_size=%s is smaller than num_threads=%s. This will limit the number "
               "of threads that can actually be used in parallel to %s, potentially hurting "
               "performance. Please set prefetch_buffer_size >= num_threads. This warning may "
               "become an error in the future.")
    with caplog.at_level(logging.WARNING):
        logging.getLogger("absl").warning(message, 8, 16, 8)  # keras-hub's
        logging.getLogger("absl").warning(message, 4, 10, 4)  # a user's own
    messages = [r.getMessage() for r in caplog.records if "prefetch_buffer_size" in r.getMessage()]
    assert len(messages) == 1 and messages[0].startswith("prefetch_buffer_size=4 is smaller than num_threads=10")


JOB_PROGRAM = '''
import sys

import jax
import numpy as np

import meshfit

strategy = meshfit.connect(sharding="fsdp", model_parallel=2, fsdp_min_bytes=1, verbose=False)
import keras
import keras_hub

folder = sys.argv[1]
keras.utils.set_random_seed(0)
with strategy.scope():
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                              head_dim=8)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(rank=4)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), sampler="greedy",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
assert not all(v.value.is_fully_addressable for v in model.trainable_variables)  # split across processes
tokens = np.random.default_rng(0).integers(1, 64, (16, 9)).astype("int32")
model.fit({"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), bool)}, tokens[:, 1:],
          batch_size=8, epochs=1, verbose=0)
backbone.save_lora_weights(folder + "/adapters.lora.h5")
prompts = {"token_ids": np.pad(tokens[:4, :3], ((0, 0), (0, 5))),
           "padding_mask": np.pad(np.ones((4, 3), bool), ((0, 0), (0, 5)))}
generated = model.generate(prompts, stop_token_ids=None)["token_ids"]
np.savez(f"{folder}/process-{jax.process_index()}.npz", generated, *model.get_weights())
'''


def test_a_job_of_two_processes_generates_and_saves_lora_adapters_split_across_them(strategy, tmp_path):
    """keras-hub on a TPU slice's shape in miniature: 2 processes x 2 devices, fsdp x model 2, LoRA
    adapters split across the processes; fit, then save_lora_weights and generate on every
    process. Both failed with JAX's "Fetching value for `jax.Array` that spans non-addressable
    ... devices" (meshfit.fit.saving). Every process gets every prompt's tokens, those one device
    gives from the same weights, and the adapters file holds the trained adapters."""
    import subprocess
    import sys

    program = tmp_path / "job.py"
    program.write_text(JOB_PROGRAM)
    done = subprocess.run([sys.executable, "-m", "meshfit", "launch", "--processes", "2",
                           "--devices-per-process", "2", "--", sys.executable, str(program), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = [list(np.load(tmp_path / f"process-{i}.npz").values()) for i in (0, 1)]
    for got, want in zip(results[1], results[0], strict=True):
        np.testing.assert_array_equal(got, want)
    generated, weights = results[0][0], results[0][1:]
    one = one_device(strategy)
    try:
        with one.scope():
            backbone = keras_hub.models.GemmaBackbone(
                vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
                hidden_dim=32, intermediate_dim=64, head_dim=8)
            model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
            backbone.enable_lora(rank=4)
            model.compile(sampler="greedy")
            model.set_weights(weights)
            tokens = np.random.default_rng(0).integers(1, 64, (16, 9)).astype("int32")
            prompts = {"token_ids": np.pad(tokens[:4, :3], ((0, 0), (0, 5))),
                       "padding_mask": np.pad(np.ones((4, 3), bool), ((0, 0), (0, 5)))}
            np.testing.assert_array_equal(model.generate(prompts, stop_token_ids=None)["token_ids"],
                                          generated)
            adapters = [np.asarray(v) for v in backbone.trainable_variables]
            backbone.load_lora_weights(str(tmp_path / "adapters.lora.h5"))
            for got, want in zip(backbone.trainable_variables, adapters, strict=True):
                np.testing.assert_array_equal(np.asarray(got), want)
            assert any(np.abs(a).sum() > 0 for a in adapters)
    finally:
        connect_eight_devices()
