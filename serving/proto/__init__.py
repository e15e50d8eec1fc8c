"""Generated protobuf/gRPC modules of the serving front ends (regenerate with
``scripts/gen_proto.sh``)."""
