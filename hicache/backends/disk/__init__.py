"""The disk tier: objects as files under one directory (`tier`), in the record format of
`records`."""
