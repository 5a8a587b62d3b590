"""Reading a cluster's log back: `laneway explain` (one request's story) and `laneway replay`
(every decision made again, and the arrivals under another policy)."""
