"""MLM learning probe (bertjax): a synthetic task where each masked id is its left neighbour + 1.

Compare with mlm_probe_hf.py (same model, data and schedule in PyTorch transformers):
    python benchmarks/mlm_probe_bertjax.py; python benchmarks/mlm_probe_hf.py
Prints step, MLM loss and MLM accuracy every 50 steps.
"""
import jax, jax.numpy as jnp, numpy as np, ml_collections
from bertjax import optim, sharding, steps
from bertjax.model import BertConfig, BertForPreTraining
from bertjax.state import create_train_state
V=200; L=32; P=5; B=32
cfg = BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, max_position_embeddings=64)
model = BertForPreTraining(cfg)
tx = optim.make_optimizer(ml_collections.ConfigDict(dict(peak_learning_rate=1e-3, warmup_steps=50, total_steps=600)))
mesh = sharding.make_mesh({"data":1})
ex=(jnp.zeros((1,8),jnp.int32),)*3+(jnp.zeros((1,2),jnp.int32),)
state,_,sh = create_train_state(model, tx, jax.random.PRNGKey(0), ex, mesh)
step = steps.jit_train_step(steps.make_train_step(model, tx), sh, mesh)
rng=np.random.default_rng(0)
def batch():
    start=rng.integers(5, V-L, (B,1)); ids=(start+np.arange(L)).astype(np.int32)
    pos=np.sort(np.stack([rng.choice(np.arange(1,L-1),P,replace=False) for _ in range(B)]),1).astype(np.int32)
    labels=np.take_along_axis(ids,pos,1); inp=ids.copy(); np.put_along_axis(inp,pos,4,1)
    return dict(input_ids=inp,input_mask=np.ones((B,L),np.int32),segment_ids=np.zeros((B,L),np.int32),masked_lm_positions=pos,masked_lm_ids=labels,masked_lm_weights=np.ones((B,P),np.float32),next_sentence_labels=rng.integers(0,2,B).astype(np.int32))
with sharding.activate(mesh):
  for i in range(600):
    state,m=step(state,sharding.global_batch_from_host(batch(),mesh))
    if i%50==0: print(i, float(m["mlm_loss_sum"]/m["mlm_weight_sum"]), float(m["mlm_correct_sum"]/m["mlm_weight_sum"]))
