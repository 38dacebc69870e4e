"""Issue 69, side study: can a cache allocate bits across layers from the prompt's own statistics (no calibration)?

Part 1 (`proxy`): per-layer statistics of an fp forward over the first N tokens of the calibration text (queries,
keys, values, attention weights, residual stream), correlated (log-log) with the per-layer KL sensitivities that the
calibrated allocation measured (`benchmarks/results/bit_allocation_study_smollm2.json`).
Part 2 (`offline`): the summed measured KL of the allocations those statistics would choose at 3.0 code bits
(greedy on weight x unit MSE of the width, key weight alpha swept), against uniform k4v2 and the allocation from
the measured sensitivities themselves. No model runs in part 2.

    python benchmarks/studies/low_bit_proxy.py smollm2 benchmarks/results/bit_allocation_study_smollm2.json 1024 OUT.json
    python benchmarks/studies/low_bit_proxy.py --offline OUT.json benchmarks/results/bit_allocation_study_smollm2.json 64
"""
import sys

if len(sys.argv) > 1 and sys.argv[1] == "--offline":
    sys.argv = sys.argv[:1] + sys.argv[2:]
    exec(compile(open(__file__.replace('low_bit_proxy.py', '_low_bit_offline.py')).read(), 'offline', 'exec'))
else:

    import json, sys, math
    import torch
    sys.path.insert(0, ".")
    torch.set_num_threads(1)
    from tq_hf_cache.eval.models import load_model
    from tq_hf_cache import texts
    from transformers import DynamicCache
    
    name, sensfile, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, tok, info = load_model(name)
    ids = tok(texts.package_text(n * 6, start=0), return_tensors="pt").input_ids[:, :n]
    layers = model.model.layers
    H, D = info["num_key_value_heads"], info["head_dim"]
    st = {}
    def hook(i, kind):
        def f(mod, inp, out):
            x = out.float()
            if x.dim() == 3:
                x = x.view(x.shape[0], x.shape[1], -1, D)
            st.setdefault(i, {})[kind] = x[0].detach()  # (T, heads, D)
        return f
    hs = []
    for i, L in enumerate(layers):
        a = L.self_attn
        if hasattr(a, "q_norm"):
            hs += [a.q_norm.register_forward_hook(hook(i, "q")), a.k_norm.register_forward_hook(hook(i, "k"))]
        else:
            hs += [a.q_proj.register_forward_hook(hook(i, "q")), a.k_proj.register_forward_hook(hook(i, "k"))]
        hs.append(a.v_proj.register_forward_hook(hook(i, "v")))
        hs.append(L.register_forward_hook(lambda m, inp, out, i=i: st[i].__setitem__("h", (out[0] if isinstance(out, tuple) else out)[0].float().detach())))
    with torch.inference_mode():
        model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    sens = json.load(open(sensfile))["sensitivity"]
    rows = []
    for i in range(len(layers)):
        s = st[i]; sc = layers[i].self_attn.scaling
        q, k, v, h = s["q"], s["k"], s["v"], s["h"]
        kc = k - k.mean(0, keepdim=True)
        qn = q.pow(2).sum(-1).mean().item() * sc * sc
        kn = k.pow(2).sum(-1).mean().item(); kcn = kc.pow(2).sum(-1).mean().item()
        vn = v.pow(2).sum(-1).mean().item(); hn = h.pow(2).sum(-1).mean().item()
        vc = (v - v.mean(0, keepdim=True)).pow(2).sum(-1).mean().item()
        T = q.shape[0]; Hq = q.shape[1]; g = Hq // H
        kk = k.repeat_interleave(g, 1); vv = v.repeat_interleave(g, 1)
        sco = torch.einsum("thd,shd->hts", q, kk) * sc
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        win = getattr(layers[i].self_attn, "sliding_window", None)
        if win: mask &= ~torch.ones(T, T, dtype=torch.bool).tril(-win)
        a = sco.masked_fill(~mask, float("-inf")).softmax(-1)  # (h, t, s)
        o = torch.einsum("hts,shd->thd", a, vv)
        qn2 = q.pow(2).sum(-1).T  # (h, t)
        kn2 = kk.pow(2).sum(-1).T  # (h, s)
        dv = (vv.permute(1, 0, 2).unsqueeze(1) - o.permute(1, 0, 2).unsqueeze(2)).pow(2).sum(-1)  # (h, t, s)
        ko = (sc * sc * qn2.unsqueeze(-1) * a * kn2.unsqueeze(1) * dv).sum(-1).mean().item() / D
        vo = (a.pow(2) * vv.pow(2).sum(-1).T.unsqueeze(1)).sum(-1).mean().item()
        t_idx = torch.arange(T)
        qmask = (t_idx.unsqueeze(1) - t_idx.unsqueeze(0) >= 128) & (t_idx.unsqueeze(0) >= 4)  # (t, s) quantized keys
        sel = t_idx >= 256
        aq = (a * qmask)[:, sel]
        mass = aq.sum(-1).mean().item()
        kcc = (k - k.mean(0, keepdim=True)).repeat_interleave(g, 1).pow(2).sum(-1).T
        koq = (sc * sc * qn2[:, sel].unsqueeze(-1) * aq * kcc.unsqueeze(1) * dv[:, sel]).sum(-1).mean().item() / D
        voq = (aq.pow(2) * vv.pow(2).sum(-1).T.unsqueeze(1)).sum(-1).mean().item()
        hmed = h.pow(2).sum(-1).median().item()
        rows.append(dict(l=i, mass=mass, koq=koq, voq=voq, hmed=hmed, ko=ko, vo=vo, qn=qn, kn=kn, kcn=kcn, vn=vn, vcn=vc, hn=hn, sk4=sens[str(i)]["key"]["4"], sv2=sens[str(i)]["value"]["2"]))
    def corr(a, b):
        a = torch.tensor(a).log(); b = torch.tensor(b).log()
        a = a - a.mean(); b = b - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))
    def spear(a, b):
        ra = torch.tensor(a).argsort().argsort().float(); rb = torch.tensor(b).argsort().argsort().float()
        ra -= ra.mean(); rb -= rb.mean(); return float((ra*rb).sum()/(ra.norm()*rb.norm()))
    for r in rows:
        print(" ".join(f"{k}={v:.3g}" for k, v in r.items()))
    sk = [r["sk4"] for r in rows]; sv = [r["sv2"] for r in rows]
    for name, f in [("qn*kn", lambda r: r["qn"]*r["kn"]), ("qn*kcn", lambda r: r["qn"]*r["kcn"]), ("kn", lambda r: r["kn"]), ("kcn", lambda r: r["kcn"]), ("qn", lambda r: r["qn"]),
                    ("mass", lambda r: r["mass"]), ("koq", lambda r: r["koq"]), ("voq", lambda r: r["voq"]), ("koq/hmed", lambda r: r["koq"]/r["hmed"]), ("voq/hmed", lambda r: r["voq"]/r["hmed"]), ("mass*kcn", lambda r: r["mass"]*r["kcn"]), ("mass*qn*kcn", lambda r: r["mass"]*r["qn"]*r["kcn"]), ("mass*vcn/hmed", lambda r: r["mass"]*r["vcn"]/r["hmed"]), ("ko",  lambda r: r["ko"]), ("ko/hn", lambda r: r["ko"]/r["hn"]), ("vo", lambda r: r["vo"]), ("vo/hn", lambda r: r["vo"]/r["hn"]), ("qn*kcn/hn", lambda r: r["qn"]*r["kcn"]/r["hn"]), ("vn", lambda r: r["vn"]), ("vn/hn", lambda r: r["vn"]/r["hn"]), ("vcn/hn", lambda r: r["vcn"]/r["hn"])]:
        x = [f(r) for r in rows]
        print(f"{name:12s} key: pearson(log) {corr(x, sk):+.2f} spearman {spear(x, sk):+.2f} | value: {corr(x, sv):+.2f} {spear(x, sv):+.2f}")
    json.dump(rows, open(sys.argv[4], "w"), indent=1)
