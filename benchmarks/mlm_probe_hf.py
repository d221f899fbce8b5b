"""MLM learning probe (PyTorch transformers), the twin of mlm_probe_bertjax.py: same config, data
and lr schedule (AdamW with bias correction here; BERT Adam in bertjax). Prints step, loss
(MLM + NSP) and MLM accuracy every 50 steps. Needs the `parity` extra.
"""
import numpy as np, torch
from transformers import BertConfig, BertForPreTraining
torch.manual_seed(0); torch.set_num_threads(1)
V=200; L=32; P=5; B=32
cfg=BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, max_position_embeddings=64)
m=BertForPreTraining(cfg); m.train()
opt=torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s+1)/50, max(0.0,(600-s)/550)))
rng=np.random.default_rng(0)
for i in range(600):
    start=rng.integers(5, V-L, (B,1)); ids=(start+np.arange(L))
    pos=np.sort(np.stack([rng.choice(np.arange(1,L-1),P,replace=False) for _ in range(B)]),1)
    labels=np.full((B,L),-100); np.put_along_axis(labels,pos,np.take_along_axis(ids,pos,1),1)
    inp=ids.copy(); np.put_along_axis(inp,pos,4,1)
    out=m(input_ids=torch.tensor(inp), labels=torch.tensor(labels), next_sentence_label=torch.tensor(rng.integers(0,2,B)))
    opt.zero_grad(); out.loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(),1.0); opt.step(); sched.step()
    if i%50==0:
        lg=out.prediction_logits.argmax(-1).numpy(); mk=labels!=-100
        print(i, round(float(out.loss),3), float((lg[mk]==labels[mk]).mean()))
