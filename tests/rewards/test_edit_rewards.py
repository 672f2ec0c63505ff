"""Edit rewards against hand-computed values: preservation outside the mask (pixel and CLIP features), the CLIP
direction score, the edited region's colour, and the VLM edit judge's request (source first, then the edit)."""

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmrl.pipelines.edits import shapes_edit_example
from mmrl.pipelines.shapes import COLORS
from mmrl.rewards import available, load
from mmrl.rewards.remote import decode_image_base64


def _example(seed=0):
    ex = shapes_edit_example(random.Random(seed), 64)
    t = lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).permute(2, 0, 1)  # noqa: E731
    mask = torch.from_numpy(np.asarray(ex["mask"].convert("L")) > 127)
    return ex, t(ex["source"]), t(ex["target"]), mask


def test_edit_rewards_are_registered():
    assert {"edit_preservation", "clip_direction", "edit_region_color", "vlm_edit_judge"} <= set(available())


def test_preservation_ignores_the_masked_region_and_measures_the_rest(tmp_path):
    ex, src, tgt, mask = _example()
    keep = load("edit_preservation")
    meta = {"source_image": ex["source"], "mask": ex["mask"]}
    assert keep(tgt[None], metadata=[meta]).scores.item() == 1.0  # the perfect edit changes only the mask
    # outside the mask: brighten a 10x10 corner by 0.2 (clamped); by hand: 1 - sum|delta| / (3 * kept pixels)
    edited = tgt.clone()
    edited[:, :10, :10] = (edited[:, :10, :10] + 0.2).clamp(max=1)
    delta = (edited - src).abs()[:, ~mask].sum().item()
    expect = 1 - delta / (3 * (~mask).sum().item())
    out = keep(edited[None], metadata=[meta])
    assert abs(out.scores.item() - expect) < 1e-6 and abs(out.details["kept_fraction"].item() - (~mask).float().mean()) < 1e-6
    # without a mask every pixel counts; the source as a path works the same as PIL
    ex["source"].save(tmp_path / "src.png")
    whole = keep(edited[None], metadata=[{"source_image": str(tmp_path / "src.png")}]).scores.item()
    assert abs(whole - (1 - (edited - src).abs().mean().item())) < 1e-6
    mse = load("edit_preservation", metric="mse")(edited[None], metadata=[meta]).scores.item()
    assert abs(mse - (1 - (edited - src).pow(2)[:, ~mask].sum().item() / (3 * (~mask).sum().item()))) < 1e-6
    with pytest.raises(ValueError, match="compares an edit with its source: pass metadata"):
        keep(tgt[None])
    with pytest.raises(ValueError, match="metric must be 'l1', 'mse' or 'clip'"):
        load("edit_preservation", metric="ssim")


def test_region_colour_is_one_for_the_right_edit_and_the_soft_distance_otherwise():
    ex, src, tgt, mask = _example(1)
    meta = {"source_image": ex["source"], "mask": ex["mask"], **ex["metadata"]}
    r = load("edit_region_color")
    assert r(tgt[None], [ex["instruction"]], [meta]).scores.item() == pytest.approx(1.0, abs=1e-6)
    # the unedited source: every region pixel is the old colour, exp(-d^2 / (2 sigma^2)) with d its RGB distance
    d2 = sum((a - b) ** 2 for a, b in zip(COLORS[meta["source_color"]], COLORS[meta["target_color"]])) / 255 ** 2
    got = r(src[None], [ex["instruction"]], [meta]).scores.item()
    assert got == pytest.approx(np.exp(-d2 / (2 * 0.25 ** 2)), abs=1e-6)
    # the target colour may come from the instruction's last word when the metadata has none
    bare = {"source_image": ex["source"], "mask": ex["mask"]}
    assert r(tgt[None], [ex["instruction"]], [bare]).scores.item() == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="scores the edited region: pass metadata"):
        r(tgt[None], [ex["instruction"]], [{"source_image": ex["source"]}])


def test_clip_scores_with_a_tiny_clip(tmp_path):
    from transformers import CLIPModel, CLIPTokenizer

    from mmrl.rewards.image._common import HFClip
    from mmrl.tiny import build_tiny_clip

    path = build_tiny_clip(tmp_path / "clip")
    ex, src, tgt, mask = _example(2)
    meta = {"source_image": ex["source"], "mask": ex["mask"], **ex["metadata"]}
    # preservation in CLIP features: the edit region is grey in both images, so any change inside it scores 1
    keep = load("edit_preservation", metric="clip", weights=str(path))
    noisy = tgt.clone()
    noisy[:, mask] = torch.rand(3, int(mask.sum()), generator=torch.Generator().manual_seed(0))
    assert keep(noisy[None], metadata=[meta]).scores.item() == pytest.approx(1.0, abs=1e-5)
    assert keep(torch.zeros_like(tgt)[None], metadata=[meta]).scores.item() < 0.999
    # direction score by hand with the CLIP model's own embedding functions
    direction = load("clip_direction", weights=str(path))
    got = direction(tgt[None], [ex["instruction"]], [meta]).scores.item()
    clip, model, tok = HFClip(path, path, "t", "t"), CLIPModel.from_pretrained(path), CLIPTokenizer.from_pretrained(path)
    with torch.no_grad():
        def img(x):
            e = model.get_image_features(pixel_values=clip.preprocess(x[None]))
            e = getattr(e, "pooler_output", e)
            return e / e.norm(dim=-1, keepdim=True)

        def txt(s):
            e = model.get_text_features(**tok([s], return_tensors="pt", padding=True))
            e = getattr(e, "pooler_output", e)
            return e / e.norm(dim=-1, keepdim=True)

        expect = F.cosine_similarity(img(tgt) - img(src), txt(meta["target_caption"]) - txt(meta["source_caption"]))
    assert got == pytest.approx(expect.item(), abs=1e-5)
    with pytest.raises(ValueError, match="needs metadata 'source_caption' and 'target_caption'"):
        direction(tgt[None], [ex["instruction"]], [{"source_image": ex["source"]}])


def test_vlm_edit_judge_sends_the_source_then_the_edit():
    ex, src, tgt, _ = _example(3)
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            first, second, text = req["messages"][0]["content"]
            seen.append((decode_image_base64(first["image_url"]["url"]), decode_image_base64(second["image_url"]["url"]),
                         text["text"]))
            body = json.dumps({"choices": [{"message": {"content": "Good edit.\nFinal Score: 4"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        judge = load("vlm_edit_judge", base_url=f"http://127.0.0.1:{server.server_port}/v1", model="judge")
        out = judge(tgt[None], [ex["instruction"]], [{"source_image": ex["source"]}])
    finally:
        server.shutdown()
    assert out.scores.item() == pytest.approx(0.8)
    (first, second, text), = seen
    assert torch.equal(first, src) and torch.equal(second, tgt)  # PNG round trip of uint8 images: exact
    assert text.endswith(f"Instruction: {ex['instruction']}") and "Preservation" in text
