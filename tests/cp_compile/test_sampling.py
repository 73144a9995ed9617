"""The sampler's filtered distribution equals HF's logits processors on the same
logits; temperature 0 is the greedy argmax; bad values are refused naming the field."""

from __future__ import annotations

import pytest
import torch
import transformers

from cp_compile.base.sampling import RequestError, Sampler, SamplingError, SamplingParams, filter_logits


def _hf_filtered(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """HF generate's sampling warpers, in generate's order (temperature, top-k, top-p)."""
    procs = transformers.LogitsProcessorList()
    procs.append(transformers.TemperatureLogitsWarper(t))
    if k > 0:
        procs.append(transformers.TopKLogitsWarper(k))
    if p < 1.0:
        procs.append(transformers.TopPLogitsWarper(p))
    return procs(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())


@pytest.mark.parametrize("t,k,p", [(0.8, -1, 0.95), (1.0, 5, 1.0), (0.7, 20, 0.9), (1.3, 3, 0.5), (0.5, -1, 0.3)])
def test_filtered_distribution_equals_hf_logits_processors(t, k, p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 128, generator=g) * 3
    logits[0, :4] = logits[0].max()  # ties at the top: top-k keeps them all, as HF does
    ours = filter_logits(logits, t, k, p)
    ref = _hf_filtered(logits, t, k, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-7, rtol=1e-6)
    kept = (~torch.isinf(ours)).sum(-1)
    assert (kept < 128).all() and (kept >= 1).all()  # something was filtered, never everything
    print(f"\nSAMPLING t={t} k={k} p={p}: kept per row {kept.tolist()}, max |dprob| vs HF "
          f"{(ours.softmax(-1) - ref.softmax(-1)).abs().max():.1e}")


def test_filter_check_fails_on_a_broken_filter():
    """The comparison above sees an off-by-one top-p cut (mutation check)."""
    logits = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)) * 3
    ref = _hf_filtered(logits, 1.0, -1, 0.9)
    broken = filter_logits(logits, 1.0, -1, 0.95)
    assert not torch.equal(torch.isinf(broken), torch.isinf(ref))


def test_samples_follow_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.9, seed=3)
    probs = filter_logits(logits, 0.9, 4, 0.9).softmax(-1)
    gen = Sampler.generator_for(params, torch.Generator())
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[Sampler().sample(logits, params, gen)] += 1
    assert counts[probs == 0].sum() == 0  # never a filtered token
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.03, rtol=0)


def test_temperature_zero_is_the_greedy_argmax_and_seeds_repeat():
    logits = torch.randn(128, generator=torch.Generator().manual_seed(2))
    assert Sampler().sample(logits, SamplingParams(temperature=0), None) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, seed=11)
    runs = []
    for _ in range(2):  # two requests with the same seed: the same tokens
        gen = Sampler.generator_for(params, torch.Generator())
        runs.append([Sampler().sample(logits, params, gen) for _ in range(20)])
    a, b = runs
    assert a == b and len(set(a)) > 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(seed="x"), "seed"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_values_refused_naming_the_field(kwargs, field):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and str(e.value).startswith(field)
    assert isinstance(e.value, RequestError) and isinstance(e.value, ValueError)
