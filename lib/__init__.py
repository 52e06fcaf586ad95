"""The course library: `lib.attention` is the tested attention code; `lib.notebook` holds the chapters' plumbing."""
