"""Load tests of recserve serving (locust): traffic, a synthetic model, a runner."""
