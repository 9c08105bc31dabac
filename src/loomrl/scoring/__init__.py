"""The scoring role: scorer executors of every kind (reward functions, reward models,
generative judges, weighted lists), their reward calls, and the controller's client
(``client.Scorer``); docs/scoring.md."""
