"""The live dashboard at /dashboard: a sampler that snapshots an app's stats every second into a
ring buffer (sampler.py), the readers that take those snapshots from `ferrylm serve` and
`ferrylm gateway` (readings.py), the routes (routes.py) and the page itself (static/: plain HTML
and a small hand-written JS file, no build step, no CDN)."""
