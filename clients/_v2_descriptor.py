"""``clients/grpc_predict_v2.proto`` compiled to a serialized FileDescriptorProto (base64).

Generated; do not edit by hand. Regenerate after changing the .proto, from the repository root
and with a Python that has grpcio-tools 1.80::

    /work/protoc-venv/bin/python -m clients._v2_descriptor
"""

from __future__ import annotations

import base64

# BEGIN GENERATED
_CHUNKS = (
    "Ch1jbGllbnRzL2dycGNfcHJlZGljdF92Mi5wcm90bxIJaW5mZXJlbmNlIhMKEVNlcnZlckxpdmVSZXF1ZXN0IigK"
    "ElNlcnZlckxpdmVSZXNwb25zZRISCgRsaXZlGAEgASgIUgRsaXZlIhQKElNlcnZlclJlYWR5UmVxdWVzdCIrChNT"
    "ZXJ2ZXJSZWFkeVJlc3BvbnNlEhQKBXJlYWR5GAEgASgIUgVyZWFkeSJBChFNb2RlbFJlYWR5UmVxdWVzdBISCgRu"
    "YW1lGAEgASgJUgRuYW1lEhgKB3ZlcnNpb24YAiABKAlSB3ZlcnNpb24iKgoSTW9kZWxSZWFkeVJlc3BvbnNlEhQK"
    "BXJlYWR5GAEgASgIUgVyZWFkeSIXChVTZXJ2ZXJNZXRhZGF0YVJlcXVlc3QiZgoWU2VydmVyTWV0YWRhdGFSZXNw"
    "b25zZRISCgRuYW1lGAEgASgJUgRuYW1lEhgKB3ZlcnNpb24YAiABKAlSB3ZlcnNpb24SHgoKZXh0ZW5zaW9ucxgD"
    "IAMoCVIKZXh0ZW5zaW9ucyJEChRNb2RlbE1ldGFkYXRhUmVxdWVzdBISCgRuYW1lGAEgASgJUgRuYW1lEhgKB3Zl"
    "cnNpb24YAiABKAlSB3ZlcnNpb24izwIKFU1vZGVsTWV0YWRhdGFSZXNwb25zZRISCgRuYW1lGAEgASgJUgRuYW1l"
    "EhoKCHZlcnNpb25zGAIgAygJUgh2ZXJzaW9ucxIaCghwbGF0Zm9ybRgDIAEoCVIIcGxhdGZvcm0SRwoGaW5wdXRz"
    "GAQgAygLMi8uaW5mZXJlbmNlLk1vZGVsTWV0YWRhdGFSZXNwb25zZS5UZW5zb3JNZXRhZGF0YVIGaW5wdXRzEkkK"
    "B291dHB1dHMYBSADKAsyLy5pbmZlcmVuY2UuTW9kZWxNZXRhZGF0YVJlc3BvbnNlLlRlbnNvck1ldGFkYXRhUgdv"
    "dXRwdXRzGlYKDlRlbnNvck1ldGFkYXRhEhIKBG5hbWUYASABKAlSBG5hbWUSGgoIZGF0YXR5cGUYAiABKAlSCGRh"
    "dGF0eXBlEhQKBXNoYXBlGAMgAygDUgVzaGFwZSKdCAoRTW9kZWxJbmZlclJlcXVlc3QSHQoKbW9kZWxfbmFtZRgB"
    "IAEoCVIJbW9kZWxOYW1lEiMKDW1vZGVsX3ZlcnNpb24YAiABKAlSDG1vZGVsVmVyc2lvbhIOCgJpZBgDIAEoCVIC"
    "aWQSTAoKcGFyYW1ldGVycxgEIAMoCzIsLmluZmVyZW5jZS5Nb2RlbEluZmVyUmVxdWVzdC5QYXJhbWV0ZXJzRW50"
    "cnlSCnBhcmFtZXRlcnMSRQoGaW5wdXRzGAUgAygLMi0uaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXF1ZXN0LkluZmVy"
    "SW5wdXRUZW5zb3JSBmlucHV0cxJRCgdvdXRwdXRzGAYgAygLMjcuaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXF1ZXN0"
    "LkluZmVyUmVxdWVzdGVkT3V0cHV0VGVuc29yUgdvdXRwdXRzEiwKEnJhd19pbnB1dF9jb250ZW50cxgHIAMoDFIQ"
    "cmF3SW5wdXRDb250ZW50cxrNAgoQSW5mZXJJbnB1dFRlbnNvchISCgRuYW1lGAEgASgJUgRuYW1lEhoKCGRhdGF0"
    "eXBlGAIgASgJUghkYXRhdHlwZRIUCgVzaGFwZRgDIAMoA1IFc2hhcGUSXQoKcGFyYW1ldGVycxgEIAMoCzI9Lmlu"
    "ZmVyZW5jZS5Nb2RlbEluZmVyUmVxdWVzdC5JbmZlcklucHV0VGVuc29yLlBhcmFtZXRlcnNFbnRyeVIKcGFyYW1l"
    "dGVycxI6Cghjb250ZW50cxgFIAEoCzIeLmluZmVyZW5jZS5JbmZlclRlbnNvckNvbnRlbnRzUghjb250ZW50cxpY"
    "Cg9QYXJhbWV0ZXJzRW50cnkSEAoDa2V5GAEgASgJUgNrZXkSLwoFdmFsdWUYAiABKAsyGS5pbmZlcmVuY2UuSW5m"
    "ZXJQYXJhbWV0ZXJSBXZhbHVlOgI4ARrzAQoaSW5mZXJSZXF1ZXN0ZWRPdXRwdXRUZW5zb3ISEgoEbmFtZRgBIAEo"
    "CVIEbmFtZRJnCgpwYXJhbWV0ZXJzGAIgAygLMkcuaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXF1ZXN0LkluZmVyUmVx"
    "dWVzdGVkT3V0cHV0VGVuc29yLlBhcmFtZXRlcnNFbnRyeVIKcGFyYW1ldGVycxpYCg9QYXJhbWV0ZXJzRW50cnkS"
    "EAoDa2V5GAEgASgJUgNrZXkSLwoFdmFsdWUYAiABKAsyGS5pbmZlcmVuY2UuSW5mZXJQYXJhbWV0ZXJSBXZhbHVl"
    "OgI4ARpYCg9QYXJhbWV0ZXJzRW50cnkSEAoDa2V5GAEgASgJUgNrZXkSLwoFdmFsdWUYAiABKAsyGS5pbmZlcmVu"
    "Y2UuSW5mZXJQYXJhbWV0ZXJSBXZhbHVlOgI4ASLfBQoSTW9kZWxJbmZlclJlc3BvbnNlEh0KCm1vZGVsX25hbWUY"
    "ASABKAlSCW1vZGVsTmFtZRIjCg1tb2RlbF92ZXJzaW9uGAIgASgJUgxtb2RlbFZlcnNpb24SDgoCaWQYAyABKAlS"
    "AmlkEk0KCnBhcmFtZXRlcnMYBCADKAsyLS5pbmZlcmVuY2UuTW9kZWxJbmZlclJlc3BvbnNlLlBhcmFtZXRlcnNF"
    "bnRyeVIKcGFyYW1ldGVycxJJCgdvdXRwdXRzGAUgAygLMi8uaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXNwb25zZS5J"
    "bmZlck91dHB1dFRlbnNvclIHb3V0cHV0cxIuChNyYXdfb3V0cHV0X2NvbnRlbnRzGAYgAygMUhFyYXdPdXRwdXRD"
    "b250ZW50cxrQAgoRSW5mZXJPdXRwdXRUZW5zb3ISEgoEbmFtZRgBIAEoCVIEbmFtZRIaCghkYXRhdHlwZRgCIAEo"
    "CVIIZGF0YXR5cGUSFAoFc2hhcGUYAyADKANSBXNoYXBlEl8KCnBhcmFtZXRlcnMYBCADKAsyPy5pbmZlcmVuY2Uu"
    "TW9kZWxJbmZlclJlc3BvbnNlLkluZmVyT3V0cHV0VGVuc29yLlBhcmFtZXRlcnNFbnRyeVIKcGFyYW1ldGVycxI6"
    "Cghjb250ZW50cxgFIAEoCzIeLmluZmVyZW5jZS5JbmZlclRlbnNvckNvbnRlbnRzUghjb250ZW50cxpYCg9QYXJh"
    "bWV0ZXJzRW50cnkSEAoDa2V5GAEgASgJUgNrZXkSLwoFdmFsdWUYAiABKAsyGS5pbmZlcmVuY2UuSW5mZXJQYXJh"
    "bWV0ZXJSBXZhbHVlOgI4ARpYCg9QYXJhbWV0ZXJzRW50cnkSEAoDa2V5GAEgASgJUgNrZXkSLwoFdmFsdWUYAiAB"
    "KAsyGS5pbmZlcmVuY2UuSW5mZXJQYXJhbWV0ZXJSBXZhbHVlOgI4ASLXAQoOSW5mZXJQYXJhbWV0ZXISHwoKYm9v"
    "bF9wYXJhbRgBIAEoCEgAUglib29sUGFyYW0SIQoLaW50NjRfcGFyYW0YAiABKANIAFIKaW50NjRQYXJhbRIjCgxz"
    "dHJpbmdfcGFyYW0YAyABKAlIAFILc3RyaW5nUGFyYW0SIwoMZG91YmxlX3BhcmFtGAQgASgBSABSC2RvdWJsZVBh"
    "cmFtEiMKDHVpbnQ2NF9wYXJhbRgFIAEoBEgAUgt1aW50NjRQYXJhbUISChBwYXJhbWV0ZXJfY2hvaWNlIsMCChNJ"
    "bmZlclRlbnNvckNvbnRlbnRzEiMKDWJvb2xfY29udGVudHMYASADKAhSDGJvb2xDb250ZW50cxIhCgxpbnRfY29u"
    "dGVudHMYAiADKAVSC2ludENvbnRlbnRzEiUKDmludDY0X2NvbnRlbnRzGAMgAygDUg1pbnQ2NENvbnRlbnRzEiMK"
    "DXVpbnRfY29udGVudHMYBCADKA1SDHVpbnRDb250ZW50cxInCg91aW50NjRfY29udGVudHMYBSADKARSDnVpbnQ2"
    "NENvbnRlbnRzEiMKDWZwMzJfY29udGVudHMYBiADKAJSDGZwMzJDb250ZW50cxIjCg1mcDY0X2NvbnRlbnRzGAcg"
    "AygBUgxmcDY0Q29udGVudHMSJQoOYnl0ZXNfY29udGVudHMYCCADKAxSDWJ5dGVzQ29udGVudHMy/AMKFEdSUENJ"
    "bmZlcmVuY2VTZXJ2aWNlEksKClNlcnZlckxpdmUSHC5pbmZlcmVuY2UuU2VydmVyTGl2ZVJlcXVlc3QaHS5pbmZl"
    "cmVuY2UuU2VydmVyTGl2ZVJlc3BvbnNlIgASTgoLU2VydmVyUmVhZHkSHS5pbmZlcmVuY2UuU2VydmVyUmVhZHlS"
    "ZXF1ZXN0Gh4uaW5mZXJlbmNlLlNlcnZlclJlYWR5UmVzcG9uc2UiABJLCgpNb2RlbFJlYWR5EhwuaW5mZXJlbmNl"
    "Lk1vZGVsUmVhZHlSZXF1ZXN0Gh0uaW5mZXJlbmNlLk1vZGVsUmVhZHlSZXNwb25zZSIAElcKDlNlcnZlck1ldGFk"
    "YXRhEiAuaW5mZXJlbmNlLlNlcnZlck1ldGFkYXRhUmVxdWVzdBohLmluZmVyZW5jZS5TZXJ2ZXJNZXRhZGF0YVJl"
    "c3BvbnNlIgASVAoNTW9kZWxNZXRhZGF0YRIfLmluZmVyZW5jZS5Nb2RlbE1ldGFkYXRhUmVxdWVzdBogLmluZmVy"
    "ZW5jZS5Nb2RlbE1ldGFkYXRhUmVzcG9uc2UiABJLCgpNb2RlbEluZmVyEhwuaW5mZXJlbmNlLk1vZGVsSW5mZXJS"
    "ZXF1ZXN0Gh0uaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXNwb25zZSIAYgZwcm90bzM="
)
# END GENERATED


def serialized() -> bytes:
    """The serialized ``FileDescriptorProto`` of ``clients/grpc_predict_v2.proto``."""
    return base64.b64decode("".join(_CHUNKS))


def _regenerate() -> None:  # pragma: no cover - a developer tool
    import re
    import tempfile
    from pathlib import Path

    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    here = Path(__file__).resolve()
    root = here.parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "v2.pb"
        code = protoc.main(
            [
                "protoc",
                f"-I{root}",
                f"--descriptor_set_out={out}",
                str(root / "clients" / "grpc_predict_v2.proto"),
            ]
        )
        if code != 0:
            raise SystemExit(f"protoc failed with exit code {code}")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    text = base64.b64encode(files[0].SerializeToString()).decode("ascii")
    lines = "".join(f'    "{text[i : i + 88]}"\n' for i in range(0, len(text), 88))
    source = here.read_text(encoding="utf-8")
    generated = f"# BEGIN GENERATED\n_CHUNKS = (\n{lines})\n# END GENERATED"
    source = re.sub(
        r"# BEGIN GENERATED\n.*?# END GENERATED", lambda _: generated, source, flags=re.S
    )
    here.write_text(source, encoding="utf-8")
    print(f"wrote {here}")


if __name__ == "__main__":
    _regenerate()
