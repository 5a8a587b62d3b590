"""The planner service: decides which worker serves each request, and says why."""
