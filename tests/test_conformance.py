"""Conformance with the authors' reference implementation (golden vectors, fp32).

Runs every ``case_*.safetensors`` in ``tests/data/golden`` and in each directory of
``STARFED_GOLDEN_DIRS`` (colon-separated) through starfed's own model code — the backbone
factory with local weight files, the first level, the second level and both replay steps —
and compares every tensor the golden README lists, at the tolerances stored with each case.
Nothing here depends on the sizes of the shipped cases.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from starfed.shared.model.backbones import Backbones, create_backbones
from starfed.shared.model.first_level import TextKeyEncoder, first_level_logits
from starfed.shared.model.losses import (
    mask_past,
    masked_cross_entropy,
    prompt_orthogonality_loss,
    query_orthogonality_loss,
)
from starfed.shared.model.replay import first_level_replay_loss, head_replay_loss
from starfed.shared.model.second_level import PromptedViT, second_level_forward

GOLDEN_DIR = Path(__file__).parent / "data" / "golden"


def golden_cases() -> list[Path]:
    dirs = [GOLDEN_DIR] + [
        Path(d) for d in os.environ.get("STARFED_GOLDEN_DIRS", "").split(":") if d
    ]
    cases = sorted({p.resolve() for d in dirs for p in d.glob("case_*.safetensors")})
    assert cases, f"no golden cases found in {dirs}"
    return cases


@dataclass
class Case:
    t: dict[str, torch.Tensor]
    meta: dict
    backbones: Backbones

    @property
    def n_past(self) -> int:
        return int(self.meta["n_past"])

    @property
    def n_seen(self) -> int:
        return int(self.meta["n_seen"])

    def check(self, name: str, actual: torch.Tensor) -> None:
        expected = self.t[name]
        tolerances = self.meta["tolerances"]
        if name in tolerances["exact"]:
            assert torch.equal(actual, expected), f"{name} differs"
            return
        tol = tolerances.get(name, tolerances["default"])
        actual = actual.detach().reshape(expected.shape).to(expected.dtype)
        torch.testing.assert_close(
            actual, expected, atol=tol["atol"], rtol=tol["rtol"], msg=lambda m: f"{name}: {m}"
        )


def backbone_config(meta: dict) -> dict:
    """A starfed backbone config (explicit sizes) equivalent to the case's CLIP and ViT."""
    cc, vc = meta["clip_config"], meta["vit_config"]
    return {
        "name": f"golden-{meta['case']}",
        "clip": {
            "embed_dim": cc["embed_dim"],
            "vision_cfg": {
                "layers": cc["vision_layers"],
                "width": cc["vision_width"],
                "head_width": cc["vision_width"] // cc["vision_heads"],
                "patch_size": cc["vision_patch_size"],
                "image_size": cc["image_resolution"],
            },
            "text_cfg": {
                "context_length": cc["context_length"],
                "vocab_size": cc["vocab_size"],
                "width": cc["transformer_width"],
                "heads": cc["transformer_heads"],
                "layers": cc["transformer_layers"],
            },
            "quick_gelu": cc["activation"] == "quick_gelu",
        },
        "vit": {
            key: vc[key]
            for key in (
                "img_size",
                "patch_size",
                "embed_dim",
                "depth",
                "num_heads",
                "mlp_ratio",
                "qkv_bias",
                "class_token",
                "global_pool",
                "in_chans",
            )
        },
        "image_size": vc["img_size"],
        "vit_mean": meta["normalisation"]["DS_MEAN"],
        "vit_std": meta["normalisation"]["DS_STD"],
        "clip_mean": meta["normalisation"]["CLIP_MEAN"],
        "clip_std": meta["normalisation"]["CLIP_STD"],
    }


@pytest.fixture(scope="module", params=golden_cases(), ids=lambda p: p.stem)
def case(request, tmp_path_factory) -> Case:
    path: Path = request.param
    t = load_file(str(path))
    meta = json.loads(path.with_suffix(".json").read_text())
    # Write the case's weights as the local files a site without a model hub would have.
    out = tmp_path_factory.mktemp(path.stem)
    clip_sd = {k.removeprefix("clip."): v for k, v in t.items() if k.startswith("clip.")}
    emb = torch.zeros(meta["clip_config"]["vocab_size"], meta["clip_config"]["transformer_width"])
    emb[t["clip_sparse.token_embedding.ids"]] = t["clip_sparse.token_embedding.rows"]
    clip_sd["token_embedding.weight"] = emb
    vit_sd = {k.removeprefix("vit."): v for k, v in t.items() if k.startswith("vit.")}
    save_file(clip_sd, str(out / "clip.safetensors"))
    save_file(vit_sd, str(out / "vit.safetensors"))
    (out / "backbone.json").write_text(json.dumps(backbone_config(meta)))
    backbones = create_backbones(
        config_path=out / "backbone.json",
        clip_weights=out / "clip.safetensors",
        vit_weights=out / "vit.safetensors",
    )
    return Case(t, meta, backbones)


def test_tokens_and_keys(case: Case) -> None:
    encoder = TextKeyEncoder(case.backbones.clip)
    tokens = encoder.tokenize(case.meta["class_names"])
    case.check("tokens", tokens)
    embeds, eot = encoder.embed_tokens(tokens)
    with torch.no_grad():
        case.check("w", encoder(case.t["p"][:, 0], embeds, eot))


def test_image_features_and_first_level_logits(case: Case) -> None:
    z = case.backbones.clip_image_features(case.t["x_clip"])
    case.check("z", z)
    encoder = TextKeyEncoder(case.backbones.clip)
    case.check("logits1", first_level_logits(z, case.t["w"], encoder.logit_scale))
    case.check(
        "logits1_masked",
        mask_past(
            first_level_logits(z, case.t["w"][: case.n_seen], encoder.logit_scale), case.n_past
        ),
    )


def test_first_stage_training_step(case: Case) -> None:
    """CE over seen classes with past masked, L_OP, the total loss and d loss / d p."""
    n_past, n_seen = case.n_past, case.n_seen
    hp = case.meta["hyperparameters"]
    encoder = TextKeyEncoder(case.backbones.clip)
    embeds, eot = encoder.embed_texts(case.meta["class_names"])
    p = case.t["p"][:, 0]
    with torch.no_grad():
        past_keys = encoder(p[:n_past], embeds[:n_past], eot[:n_past])
    current = p[n_past:n_seen].clone().requires_grad_(True)
    keys = torch.cat([past_keys, encoder(current, embeds[n_past:n_seen], eot[n_past:n_seen])])
    z = case.backbones.clip_image_features(case.t["x_clip"])
    logits = first_level_logits(z, keys, encoder.logit_scale)
    ce = masked_cross_entropy(logits, case.t["labels"], n_past)
    l_op = prompt_orthogonality_loss(current, p[:n_past])
    loss = ce + hp["lambda_ortho_first_stage"] * l_op
    loss.backward()
    case.check("ce1", ce)
    case.check("L_OP", l_op)
    case.check("loss1", loss)
    grad = torch.zeros_like(p)
    grad[n_past:n_seen] = current.grad
    case.check("grad1_p", grad)


def test_second_stage_forward_and_training_step(case: Case) -> None:
    """Similarities, selections, residuals, CLS features, logits, L_OQ and all gradients."""
    n_past, n_seen = case.n_past, case.n_seen
    t, hp = case.t, case.meta["hyperparameters"]
    vit = PromptedViT(case.backbones.vit, case.backbones.fast_towers)
    z = case.backbones.clip_image_features(t["x_clip"])
    q_cur = t["Q"][n_past:n_seen].clone().requires_grad_(True)
    a_cur = t["A"][n_past:n_seen].clone().requires_grad_(True)
    w_cur = t["vit.head.weight"][n_past:n_seen].clone().requires_grad_(True)
    b_cur = t["vit.head.bias"][n_past:n_seen].clone().requires_grad_(True)
    out = second_level_forward(
        vit,
        t["x_vit"],
        z,
        keys=t["w"][:n_seen],
        query_weights=torch.cat([t["A"][:n_past], a_cur]),
        query_prompts=torch.cat([t["Q"][:n_past], q_cur]),
    )
    case.check("s", out.similarity)
    case.check("cstar", out.selected)
    case.check("residual", out.residuals)
    case.check("cls_feat", out.features)
    with torch.no_grad():
        case.check("cls_feat_noprompt", vit(t["x_vit"]))
        case.check(
            "logits2",
            torch.nn.functional.linear(out.features, t["vit.head.weight"], t["vit.head.bias"]),
        )
    head_w = torch.cat([t["vit.head.weight"][:n_past], w_cur])
    head_b = torch.cat([t["vit.head.bias"][:n_past], b_cur])
    logits = torch.nn.functional.linear(out.features, head_w, head_b)
    case.check("logits2_masked", mask_past(logits, n_past))
    ce = masked_cross_entropy(logits, t["labels"], n_past)
    l_oq = query_orthogonality_loss(q_cur, t["Q"][:n_past])
    loss = ce + hp["lambda_ortho_second_stage"] * l_oq
    loss.backward()
    case.check("ce2", ce)
    case.check("L_OQ", l_oq)
    case.check("loss2", loss)
    for name, param, full in (
        ("grad2_Q", q_cur, t["Q"]),
        ("grad2_A", a_cur, t["A"]),
        ("grad2_head_weight", w_cur, t["vit.head.weight"]),
        ("grad2_head_bias", b_cur, t["vit.head.bias"]),
    ):
        grad = torch.zeros_like(full)
        grad[n_past:n_seen] = param.grad
        case.check(name, grad)


def test_first_stage_replay_step(case: Case) -> None:
    n_past, n_seen = case.n_past, case.n_seen
    t, hp = case.t, case.meta["hyperparameters"]
    encoder = TextKeyEncoder(case.backbones.clip)
    embeds, eot = encoder.embed_texts(case.meta["class_names"])
    p = t["p"][:, 0]
    with torch.no_grad():
        past_keys = encoder(p[:n_past], embeds[:n_past], eot[:n_past])
    current = p[n_past:n_seen].clone().requires_grad_(True)
    loss = first_level_replay_loss(
        encoder,
        t["gr1_features"],
        t["gr1_labels"],
        past_keys,
        current,
        embeds[n_past:n_seen],
        eot[n_past:n_seen],
    )
    case.check("gr1_loss", loss)
    loss.backward()
    after = p.clone()
    with torch.no_grad():
        after[n_past:n_seen] = current - hp["lr_gr_first_stage"] * current.grad
    case.check("gr1_p_after", after)


def test_second_stage_replay_step(case: Case) -> None:
    n_seen = case.n_seen
    t, hp = case.t, case.meta["hyperparameters"]
    w = t["vit.head.weight"][:n_seen].clone().requires_grad_(True)
    b = t["vit.head.bias"][:n_seen].clone().requires_grad_(True)
    loss = head_replay_loss(t["gr2_features"], t["gr2_labels"], w, b)
    case.check("gr2_loss", loss)
    optimizer = torch.optim.SGD([w, b], lr=hp["lr_gr_second_stage"], momentum=0.0)
    loss.backward()
    optimizer.step()
    w_after, b_after = t["vit.head.weight"].clone(), t["vit.head.bias"].clone()
    w_after[:n_seen], b_after[:n_seen] = w.detach(), b.detach()
    case.check("gr2_head_weight_after", w_after)
    case.check("gr2_head_bias_after", b_after)
