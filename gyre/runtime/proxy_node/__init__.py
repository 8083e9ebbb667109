"""The proxy node's rank (world rank 1): the proxy every harness talks to, the harness pool
that launches executions, and the evaluator that scores them (`node`)."""
