"""The Runner over a float32 llama install: logits, generate, stream, chat, stops, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.errors import ContextOverflowError, OptionError, TurbosparkError
from turbospark_core.runner import Generation, Runner

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def install(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("runner") / "llama-f32"
    convert(llama_src, dst, dtype="float32")
    return dst


@pytest.fixture(scope="module")
def runner(install: Path) -> Runner:
    return turbospark_core.open(install)


@pytest.fixture(scope="module")
def prompt(references: dict[str, np.ndarray]) -> list[int]:
    return references["prompt_ids"].tolist()


@pytest.fixture(scope="module")
def greedy(runner: Runner, prompt: list[int]) -> Generation:
    return runner.generate(prompt, max_tokens=16)


# ------------------------------------------------------------------ logits


def test_logits_shape_dtype_and_values(runner: Runner, prompt: list[int], references: dict[str, np.ndarray]) -> None:
    logits = runner.logits(prompt)
    assert isinstance(logits, np.ndarray)
    assert logits.shape == (len(prompt), 512) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, references["logits"], rtol=1e-4, atol=1e-4)


def test_logits_use_a_fresh_context_each_call(runner: Runner, prompt: list[int]) -> None:
    a, b = prompt[:20], prompt[20:]
    before = runner.logits(a)
    runner.logits(b)
    runner.generate(b, max_tokens=4)
    np.testing.assert_allclose(runner.logits(a), before, rtol=0, atol=1e-6)
    # a prefix's logits are the prefix rows of the longer sequence's (causal, no leakage)
    np.testing.assert_allclose(runner.logits(prompt)[:20], before, atol=1e-5)


@pytest.mark.parametrize("ids", [[512], [-1], [5, 10_000], []], ids=["vocab", "negative", "far", "empty"])
def test_bad_token_ids_are_refused(runner: Runner, ids: list[int]) -> None:
    with pytest.raises(OptionError) as err:
        runner.logits(ids)
    if ids:
        assert str(next(t for t in ids if not 0 <= t < 512)) in str(err.value)
        assert "512" in str(err.value)
    with pytest.raises(OptionError):
        runner.generate(ids, max_tokens=1)


def test_too_long_input_is_refused(install: Path) -> None:
    small = turbospark_core.open(install, max_context=16)
    assert small.max_context == 16
    with pytest.raises(ContextOverflowError, match="max_context=16"):
        small.logits(list(range(20, 37)))
    with pytest.raises(ContextOverflowError, match="max_tokens"):
        small.generate(list(range(20, 30)), max_tokens=7)
    assert len(small.generate(list(range(20, 30)), max_tokens=6).tokens) <= 6


def test_a_long_prompt_takes_its_cache_room_once(
    install: Path, prompt: list[int], cache_growths: list[tuple[int, int]]
) -> None:
    """A prompt of three chunks grows each full-attention cache once, before its first chunk (growing a
    step at a time had copied everything held at every chunk)."""
    long = turbospark_core.open(install, max_context=1400)
    cache_growths.clear()  # the open's one-token shape check
    long.generate((prompt * (1200 // len(prompt) + 1))[:1200], max_tokens=1)
    assert cache_growths and len(cache_growths) == len({cache for cache, _ in cache_growths})  # one growth a cache
    assert {size for _, size in cache_growths} == {1280}  # the prompt's 1,200 tokens in whole steps of 256


# ------------------------------------------------------------------ generate


def test_generate_returns_text_tokens_and_mlx_lm_stats(greedy: Generation, prompt: list[int], runner: Runner) -> None:
    assert isinstance(greedy, Generation)
    assert len(greedy.tokens) == 16 and all(isinstance(t, int) for t in greedy.tokens)
    assert greedy.text == runner.tokenizer.decode(greedy.tokens)
    s = greedy.stats
    assert s.prompt_tokens == len(prompt) and s.generation_tokens == 16
    assert s.prompt_tps > 0 and s.generation_tps > 0
    assert isinstance(s.peak_memory, float) and s.peak_memory >= 0
    assert greedy.finish_reason == "length"


def test_greedy_generate_matches_the_reference(greedy: Generation, references: dict[str, np.ndarray]) -> None:
    assert greedy.tokens == references["greedy_tokens"].tolist()


def test_greedy_generate_is_argmax_of_full_forward_logits(
    runner: Runner, greedy: Generation, prompt: list[int]
) -> None:
    full = runner.logits(prompt + greedy.tokens)
    for i, token in enumerate(greedy.tokens):
        assert int(np.argmax(full[len(prompt) - 1 + i])) == token, f"step {i}"


def test_text_prompt_is_tokenized_with_the_install_tokenizer(runner: Runner) -> None:
    text = runner.generate("Once upon a time", max_tokens=5)
    ids = runner.generate(runner.tokenizer.encode("Once upon a time"), max_tokens=5)
    assert text.tokens == ids.tokens and text.stats.prompt_tokens == ids.stats.prompt_tokens


def test_max_tokens_zero(runner: Runner, prompt: list[int]) -> None:
    gen = runner.generate(prompt, max_tokens=0)
    assert gen.text == "" and gen.tokens == []
    assert gen.stats.generation_tokens == 0 and gen.stats.prompt_tokens == len(prompt)


@pytest.mark.parametrize("max_tokens", [-1, 1.5, True])
def test_bad_max_tokens_is_refused(runner: Runner, max_tokens: object) -> None:
    with pytest.raises(OptionError, match="max_tokens"):
        runner.generate("hi", max_tokens=max_tokens)  # type: ignore[arg-type]


def test_bad_sampling_value_is_refused_by_name(runner: Runner) -> None:
    with pytest.raises(OptionError, match="top_p"):
        runner.generate("hi", max_tokens=2, top_p=2.0)


def test_unknown_sampling_option_is_refused_by_name(runner: Runner) -> None:
    with pytest.raises(OptionError, match="temprature"):
        runner.generate("hi", max_tokens=2, temprature=0.7)


def test_seeded_sampling_is_reproducible(runner: Runner, prompt: list[int]) -> None:
    kw = {"temperature": 1.0, "top_p": 0.95, "seed": 3}
    a = runner.generate(prompt, max_tokens=12, **kw)
    b = runner.generate(prompt, max_tokens=12, **kw)
    c = runner.generate(prompt, max_tokens=12, **{**kw, "seed": 4})
    assert a.tokens == b.tokens and a.text == b.text
    assert a.tokens != c.tokens


def test_repetition_penalty_changes_greedy_output(runner: Runner, prompt: list[int], greedy: Generation) -> None:
    penalised = runner.generate(prompt, max_tokens=16, repetition_penalty=5.0)
    assert penalised.tokens != greedy.tokens


# ------------------------------------------------------------------ EOS and stop strings


def test_eos_ends_generation_and_is_excluded(runner: Runner, greedy: Generation, prompt: list[int]) -> None:
    # make the third greedy token the EOS of a second runner on the same opened model
    eos = greedy.tokens[2]
    first = greedy.tokens.index(eos)
    other = Runner(runner.opened, runner.tokenizer)
    other.eos_token_ids = frozenset({eos})
    gen = other.generate(prompt, max_tokens=16)
    assert gen.tokens == greedy.tokens[:first]
    assert eos not in gen.tokens
    assert gen.finish_reason == "stop" and gen.stats.generation_tokens == first
    assert gen.text == runner.tokenizer.decode(greedy.tokens[:first])


def test_install_eos_ids_come_from_the_generation_config(runner: Runner) -> None:
    assert runner.eos_token_ids == frozenset({2, 4})


def _stop_inside(text: str) -> str:
    """A 3-character stop string that occurs a few characters into ``text`` (and not before)."""
    for start in range(2, len(text) - 3):
        stop = text[start : start + 3]
        if text.find(stop) == start and "\ufffd" not in stop:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text(runner: Runner, prompt: list[int], greedy: Generation) -> None:
    stop = _stop_inside(greedy.text)
    gen = runner.generate(prompt, max_tokens=16, stop=stop)
    assert gen.text == greedy.text[: greedy.text.index(stop)]
    assert gen.finish_reason == "stop"
    assert stop not in gen.text


def test_multiple_stop_strings_earliest_wins(runner: Runner, prompt: list[int], greedy: Generation) -> None:
    stop = _stop_inside(greedy.text)
    gen = runner.generate(prompt, max_tokens=16, stop=["never appears §§", stop])
    assert gen.text == greedy.text[: greedy.text.index(stop)]


def test_absent_stop_string_changes_nothing(runner: Runner, prompt: list[int], greedy: Generation) -> None:
    gen = runner.generate(prompt, max_tokens=16, stop=["never appears §§"])
    assert gen.text == greedy.text and gen.tokens == greedy.tokens and gen.finish_reason == "length"


# ------------------------------------------------------------------ stream


def test_stream_pieces_join_to_generate_text(runner: Runner, prompt: list[int], greedy: Generation) -> None:
    stream = runner.stream(prompt, max_tokens=16)
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.result
    pieces = list(stream)
    assert all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == greedy.text
    assert stream.result.text == greedy.text and stream.result.tokens == greedy.tokens


def test_stream_with_stop_matches_generate(runner: Runner, prompt: list[int], greedy: Generation) -> None:
    stop = _stop_inside(greedy.text)
    stream = runner.stream(prompt, max_tokens=16, stop=stop)
    assert "".join(stream) == runner.generate(prompt, max_tokens=16, stop=stop).text == stream.result.text


# ------------------------------------------------------------------ chat


def test_chat_prompt_is_the_rendered_template_encoded(runner: Runner) -> None:
    text = runner.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = runner.chat_prompt(MESSAGES)
    assert ids == runner.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 1  # the template's BOS, not a second one


def test_chat_generates_from_the_chat_prompt(runner: Runner) -> None:
    chat = runner.chat(MESSAGES, max_tokens=6)
    plain = runner.generate(runner.chat_prompt(MESSAGES), max_tokens=6)
    assert chat.tokens == plain.tokens and chat.text == plain.text
    assert chat.stats.prompt_tokens == len(runner.chat_prompt(MESSAGES))
    assert "".join(runner.chat_stream(MESSAGES, max_tokens=6)) == chat.text


def test_empty_chat_is_refused(runner: Runner) -> None:
    with pytest.raises(OptionError, match="messages"):
        runner.chat([])


# ------------------------------------------------------------------ open facts


def test_runner_facts(runner: Runner) -> None:
    assert runner.max_context == 256  # min(max_position_embeddings, default)
    assert runner.manifest.model_type == "llama"
    assert runner.opened.capabilities.family == "llama"
    stats = runner.startup_stats.as_dict()
    assert stats["total_open"] > 0 and stats["total_open"] >= stats["family_state"]
    assert issubclass(OptionError, TurbosparkError)
