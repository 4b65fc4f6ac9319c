#!/usr/bin/env python3
"""Asks SERVER (UDP 53) for the A records of NAME; exits 0 when EXPECTED
(if given) is among them, printing the addresses. scripts/cluster's check
that the cluster's DNS answers, without a DNS client installed."""
import random
import socket
import struct
import sys


def query(server, name):
    qid = random.randrange(1 << 16)
    packet = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.rstrip(".").split("."):
        packet += bytes([len(label)]) + label.encode()
    packet += b"\0" + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(2)
        s.sendto(packet, (server, 53))
        data, _ = s.recvfrom(4096)
    rid, flags, qd, an = struct.unpack(">HHHH", data[:8])
    if rid != qid or flags & 0xF:
        return []
    pos = 12
    for _ in range(qd):
        while data[pos]:
            pos += data[pos] + 1
        pos += 5
    out = []
    for _ in range(an):
        if data[pos] & 0xC0 == 0xC0:
            pos += 2
        else:
            while data[pos]:
                pos += data[pos] + 1
            pos += 1
        rtype, _cls, _ttl, rdlen = struct.unpack(">HHIH", data[pos:pos + 10])
        pos += 10
        if rtype == 1 and rdlen == 4:
            out.append(socket.inet_ntoa(data[pos:pos + 4]))
        pos += rdlen
    return out


def main():
    server, name = sys.argv[1], sys.argv[2]
    expected = sys.argv[3] if len(sys.argv) > 3 else None
    addrs = query(server, name)
    print(" ".join(addrs))
    sys.exit(0 if addrs and (expected is None or expected in addrs) else 1)


if __name__ == "__main__":
    main()
