"""lm-evaluation-harness integration: the ``kvpolicy`` model (``KVPolicyLM``).

Importing this package registers the model under the name ``kvpolicy`` in lm-eval's model
registry (lm-eval 0.4.x finds models only through that registry, not through package entry
points). From the shell, ``kvpolicy-lm-eval`` (or ``python -m kvpolicy.eval.lmeval``) is
lm-eval's own command line with the model registered::

    kvpolicy-lm-eval --model kvpolicy \\
        --model_args pretrained=Qwen/Qwen3-4B,policy=snapkv,budget=512,dtype=bfloat16,device=cuda \\
        --tasks gsm8k --batch_size 16 --apply_chat_template

From Python: ``import kvpolicy.eval.lmeval`` and then ``lm_eval.simple_evaluate(model="kvpolicy", ...)``,
or pass a ``KVPolicyLM`` instance as ``model``.
"""

from .model import KVPolicyLM

__all__ = ["KVPolicyLM"]
