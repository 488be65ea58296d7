"""The bottom layer: what every other package shares and nothing of ours is imported by it.

``env`` reads settings from the environment, ``dtypes`` names the wire's
dtypes, ``payload`` is the compressed form of one tensor (what compressors
make, the wire carries and servers add up), ``seeded`` regenerates a random-k
payload's positions from its seed, and ``timing`` times calls on any device.
"""
