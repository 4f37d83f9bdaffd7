"""Kubernetes name rules the run's names must follow (pure): one place for each pattern and length limit."""

from __future__ import annotations

import re

from rlrun_api import constants

# RFC 1123 label (a namespace name): lower-case letters, digits and '-', <= 63, alphanumeric at both ends.
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
# RFC 1035 label (a Service name): as above, but starting with a letter.
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")

# The longest run name whose children all have valid names: children are named <name><suffix>
# (constants.CHILD_SUFFIXES), each a DNS-1035 label (<= 63), and the StatefulSet's name is shorter still
# (constants.STATEFULSET_NAME_MAX_LENGTH). 44 today; the CRD's metadata.name maxLength says the same (tested).
MAX_RUN_NAME_LENGTH = min(
    [constants.DNS_LABEL_MAX_LENGTH - len(s) for s in constants.CHILD_SUFFIXES]
    + [constants.STATEFULSET_NAME_MAX_LENGTH - len(s) for s in constants.STATEFULSET_SUFFIXES]
)
