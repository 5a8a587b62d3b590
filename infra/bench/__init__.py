"""`laneway bench`: replay real request traces offline (simulated clock) or live."""
