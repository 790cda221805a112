"""Loss terms as pure functions of a module's forward output and a train batch.

``distribution`` is the factored categorical action distribution (per-head log-probs and
entropies), ``ppo`` is RLlib's PPO loss, term by term, with those per-head log-probs kept, and
``regularizers`` are the terms a run adds to it.  The learner (``rllib/``) sums them; the gradient probe (``probe/``)
takes each term's gradient separately.  Both sit above this package, which imports neither.
"""
