"""`verl-agent rollout` and `verl-agent eval`: `evaluate` runs them over what `rollout.build` builds;
`passk` computes pass@1, pass@k and maj@k from the trajectories."""
