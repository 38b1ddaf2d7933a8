"""TEMPORARY hyperparameter sweep (deleted before hand-off)."""
import dataclasses, json, sys, time, torch
from concurrent.futures import ThreadPoolExecutor
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl_agent.models.tiny import TinySettings
from verl_agent.models.calculator_task import make_problems
from verl_agent.models.sft_train import make_dataset, train
from verl_agent.models.evaluate import evaluate_rates

def run(kw, dev):
    s = dataclasses.replace(TinySettings(), **kw)
    torch.manual_seed(0)
    tok, data = make_dataset(make_problems(s.n_train_problems, 0, "train"), s, 0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    m = Qwen2ForCausalLM(cfg).to(dev)
    t = time.time(); losses = train(m, data, s, 0); tt = time.time() - t
    r = evaluate_rates(m, tok, make_problems(128, 1, "test"), 1.0, 0)
    g = evaluate_rates(m, tok, make_problems(128, 1, "test"), 0.0, 0)
    out = dict(kw=kw, tool=r.tool_call_rate, succ=r.success_rate, gtool=g.tool_call_rate, gsucc=g.success_rate,
               loss=sum(losses[-20:]) / 20, train_s=round(tt, 1))
    print(json.dumps(out), flush=True)

torch.set_num_threads(1)
run(json.loads(sys.argv[1]), "cuda")
