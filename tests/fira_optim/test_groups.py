"""Param-group helpers: ``param_groups`` on a tiny Llama, and ``divide_params`` against the released
``fira.divide_params``."""

import re

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from fira_optim import FiraAdamW, divide_params, param_groups

from .released import quiet_fira_divide_params

PROJECTED_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


def _names(model, params):
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
    return [by_id[id(p)] for p in params]


def _projected_and_plain(groups):
    projected = [p for g in groups if g.get("rank") is not None for p in g["params"]]
    plain = [p for g in groups if g.get("rank") is None for p in g["params"]]
    return projected, plain


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_projects_attention_and_mlp_only(tie):
    model = _llama(tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    groups = param_groups(model, rank=4, update_proj_gap=50, alpha=0.25)
    projected, plain = _projected_and_plain(groups)
    names = _names(model, projected)
    assert len(names) == 2 * len(PROJECTED_NAMES)
    assert all(re.search(r"\.(%s)\.weight$" % "|".join(PROJECTED_NAMES), n) for n in names)
    plain_names = _names(model, plain)
    assert "model.embed_tokens.weight" in plain_names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    if not tie:
        assert "lm_head.weight" in plain_names
    # Every trainable parameter exactly once, tied weights included.
    everything = projected + plain
    assert len({id(p) for p in everything}) == len(everything) == len(list(model.parameters()))
    assert groups[-1]["rank"] == 4 and groups[-1]["update_proj_gap"] == 50
    assert groups[-1]["alpha"] == 0.25


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_groups_build_an_optimizer_that_trains(tie):
    model = _llama(tie)
    opt = FiraAdamW(param_groups(model, rank=4, update_proj_gap=2), lr=1e-2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    q_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    emb_before = model.model.embed_tokens.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_before)
    assert not torch.equal(model.model.embed_tokens.weight, emb_before)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert "basis" in opt.state[q] and "basis" not in opt.state[model.model.embed_tokens.weight]


def test_include_and_exclude_patterns():
    model = _llama(False)
    projected, _ = _projected_and_plain(param_groups(model, rank=4, include="mlp"))
    assert sorted(n.split(".")[-2] for n in _names(model, projected)) == sorted(
        ["gate_proj", "up_proj", "down_proj"] * 2)
    projected, plain = _projected_and_plain(
        param_groups(model, rank=4, exclude=[r"o_proj", r"layers\.1\."]))
    names = _names(model, projected)
    assert len(names) == 6 and all(n.startswith("model.layers.0.") for n in names)
    assert not any("o_proj" in n for n in names)
    assert "model.layers.0.self_attn.o_proj.weight" in _names(model, plain)
    projected, _ = _projected_and_plain(param_groups(model, rank=4, include=["q_proj", "k_proj"],
                                                     exclude="k_proj"))
    assert [n.split(".")[-2] for n in _names(model, projected)] == ["q_proj", "q_proj"]
    # patterns as a generator (an Iterable): read once, for every module (they were consumed by
    # the check of the patterns, then matched nothing)
    projected, _ = _projected_and_plain(param_groups(model, rank=4, include=(p for p in ["q_proj"])))
    assert [n.split(".")[-2] for n in _names(model, projected)] == ["q_proj", "q_proj"]


def test_a_pattern_that_is_not_a_regular_expression_is_refused_naming_its_argument():
    model = _llama(False)
    with pytest.raises(ValueError, match=r"include='\(\(' is not a regular expression"):
        param_groups(model, include="((")
    with pytest.raises(ValueError, match=r"exclude='\[' is not a regular expression"):
        param_groups(model, exclude=["mlp", "["])


def test_parameters_instead_of_the_model_are_a_type_error_naming_what_it_takes():
    model = _llama(False)
    with pytest.raises(TypeError, match=r"takes the model \(an nn.Module\), got generator"):
        param_groups(model.parameters())


def test_group_options_go_to_the_projected_group():
    model = _llama(True)
    groups = param_groups(model, rank=4, proj_type="left", gamma=1.1, limiter="clip")
    projected = [g for g in groups if g["rank"] is not None]
    assert len(projected) == 1
    assert projected[0]["proj_type"] == "left" and projected[0]["gamma"] == 1.1
    assert all("proj_type" not in g for g in groups if g["rank"] is None)
    opt = FiraAdamW(groups)
    assert opt.param_groups[-1]["limiter"] == "clip" and opt.param_groups[0]["limiter"] == "growth"
    # a misspelt option was kept on the group (torch keeps any key) and trained at the default rank
    with pytest.raises(TypeError, match=r"unexpected option 'rnak' \(did you mean 'rank'\?\)"):
        param_groups(model, rnak=8)
    with pytest.raises(TypeError, match="unexpected option 'gama'"):
        param_groups(model, gama=1.1)
    assert param_groups(model, scale=0.5)[-1]["scale"] == 0.5  # galore-torch's name for alpha


class _TiedToy(nn.Module):
    """No get_output_embeddings: the head is found as a Linear tied to an Embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.block = nn.Linear(8, 8)
        self.shared_a = nn.Linear(8, 12)
        self.shared_b = nn.Linear(8, 12)
        self.shared_b.weight = self.shared_a.weight  # one weight used by two layers
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 30, bias=False)
        self.head.weight = self.emb.weight


def test_tied_and_frozen_weights_without_hf_helpers():
    model = _TiedToy()
    projected, plain = _projected_and_plain(param_groups(model, rank=2))
    assert {id(p) for p in projected} == {id(model.block.weight), id(model.shared_a.weight)}
    assert len(projected) == 2  # the shared weight once
    assert any(p is model.emb.weight for p in plain)
    assert not any(p is model.frozen.weight or p is model.frozen.bias for p in projected + plain)
    FiraAdamW(param_groups(model, rank=2))  # no "more than one parameter group" error


def test_divide_params_matches_released_fira_and_prints_nothing(capsys):
    model = _llama(True)
    args = dict(target_modules_list=["attn", "mlp"], rank=4, update_proj_gap=50, alpha=0.25,
                proj_type="std")
    theirs = quiet_fira_divide_params(model, **args)
    ours = divide_params(model, **args)
    assert capsys.readouterr().out == ""
    assert len(ours) == len(theirs) == 2
    for mine, ref in zip(ours, theirs):
        assert mine.keys() == ref.keys()
        assert [id(p) for p in mine["params"]] == [id(p) for p in ref["params"]]
        assert {k: v for k, v in mine.items() if k != "params"} == {
            k: v for k, v in ref.items() if k != "params"}
    assert len(ours[1]["params"]) == 14
    FiraAdamW(ours, lr=1e-2)  # the released groups build our optimizer unchanged


def test_divide_params_lists_a_weight_shared_by_two_matched_layers_once():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[2].weight = model[0].weight
    projected, plain = _projected_and_plain(divide_params(model, ["0", "2"], rank=2))
    assert [id(p) for p in projected] == [id(model[0].weight)]
    assert {id(p) for p in plain} == {id(model[0].bias), id(model[2].bias)}
    FiraAdamW(divide_params(model, ["0", "2"], rank=2))  # no duplicate-parameter refusal


def test_divide_params_refuses_what_is_not_a_model_naming_the_argument():
    """The released helper returned None for model=None (FiraAdamW then failed on it, "'NoneType'
    object is not iterable"); here the helper says what it takes."""
    with pytest.raises(TypeError, match=r"divide_params\(\) takes the model \(an nn.Module\), got model=None"):
        divide_params(None)
    with pytest.raises(TypeError, match="got model of type generator"):
        divide_params(_llama(False).parameters(), ["mlp"])


def test_divide_params_defaults_match_released():
    model = _llama(False)
    ours = divide_params(model, ["mlp"])
    theirs = quiet_fira_divide_params(model, ["mlp"])
    assert {k: v for k, v in ours[1].items() if k != "params"} == {
        k: v for k, v in theirs[1].items() if k != "params"}
    assert [id(p) for p in ours[0]["params"]] == [id(p) for p in theirs[0]["params"]]


def test_gpt2s_conv1d_layers_are_projected_and_train():
    """GPT-2's attention and MLP layers are transformers' Conv1D (weight in x out), not nn.Linear:
    they were silently left out, and the optimizer was plain AdamW."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    projected, plain = _projected_and_plain(param_groups(model, rank=4))
    names = _names(model, projected)
    assert sorted({n.split(".")[-2] for n in names}) == ["c_attn", "c_fc", "c_proj"] and len(names) == 8
    assert "transformer.wte.weight" in _names(model, plain)  # embeddings and the tied head: never
    opt = FiraAdamW(param_groups(model, rank=4, update_proj_gap=2), lr=1e-2)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids).loss
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0]
    assert all("basis" in opt.state[p] for p in projected)


def test_a_model_with_nothing_to_project_warns():
    model = nn.Sequential(nn.Bilinear(4, 4, 4), nn.Embedding(10, 4))  # 2-D weights, none a linear layer's
    with pytest.warns(UserWarning, match="nothing is projected, and the optimizer is plain AdamW"):
        groups = param_groups(model, rank=2)
    assert [g["rank"] for g in groups] == [None]


def _groups_of(helper: str, model: nn.Module) -> list[dict]:
    return param_groups(model, rank=2) if helper == "param_groups" else divide_params(model, ["0", "2"], rank=2)


@pytest.mark.parametrize("helper", ["param_groups", "divide_params"])
@pytest.mark.parametrize("parametrize", [nn.utils.parametrizations.weight_norm,
                                         nn.utils.parametrizations.spectral_norm,
                                         nn.utils.parametrizations.orthogonal])
def test_a_parametrized_linear_weight_is_left_to_its_parameters_in_the_plain_group(parametrize, helper):
    """A weight computed from parameters (weight_norm and the like) is no parameter: it went to the
    projected group, and FiraAdamW refused the groups ("can't optimize a non-leaf Tensor"), from
    either helper (the released divide_params does so too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 8))
    parametrize(model[0])
    projected, plain = _projected_and_plain(_groups_of(helper, model))
    assert [id(p) for p in projected] == [id(model[2].weight)]
    assert {id(p) for p in model[0].parametrizations.weight.parameters()} <= {id(p) for p in plain}
    opt = FiraAdamW(_groups_of(helper, model), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 12)).pow(2).sum().backward()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("helper", ["param_groups", "divide_params"])
def test_building_the_groups_leaves_a_parametrized_weight_uncomputed(helper):
    """Reading a parametrized weight computes it: param_groups(model) ran a power iteration of
    spectral_norm's (its u and v moved, as if the model had taken a training forward pass)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 8))
    nn.utils.parametrizations.spectral_norm(model[0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _groups_of(helper, model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_building_the_groups_leaves_a_parametrized_embedding_and_head_uncomputed():
    """The embeddings and the output head are looked up to be left out, and reading their weight
    computed it too: spectral_norm's u and v moved on an embedding or a head so parametrized."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10)

        def get_output_embeddings(self):
            return self.head

    torch.manual_seed(0)
    model = Model()
    nn.utils.parametrizations.spectral_norm(model.emb)
    nn.utils.parametrizations.spectral_norm(model.head)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    groups = param_groups(model, rank=2)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    projected = next(g for g in groups if g["rank"] is not None)["params"]
    assert len(projected) == 1 and projected[0] is model.mid.weight
