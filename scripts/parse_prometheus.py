#!/usr/bin/env python3
"""Parses Prometheus text (stdin) with prometheus_client's own parser, as a Prometheus server reads
a scrape, and prints JSON: {"families": {name: {"type": ..., "samples": [[name, labels, value], ...]}}}.
Exit 1 when the text does not parse."""

import json
import sys

from prometheus_client.parser import text_string_to_metric_families


def main():
    text = sys.stdin.read()
    families = {}
    try:
        for family in text_string_to_metric_families(text):
            families[family.name] = {
                "type": family.type,
                "samples": [[s.name, s.labels, s.value] for s in family.samples],
            }
    except ValueError as e:
        sys.exit(f"not Prometheus text: {e}")
    print(json.dumps({"families": families}))


if __name__ == "__main__":
    main()
