import socket, time, sys
addr=(sys.argv[1], int(sys.argv[2])); n=int(sys.argv[3])
conns=[]; t=time.time(); fails=0
for i in range(n):
    s=socket.socket(); s.settimeout(1)
    try:
        s.connect(addr); conns.append(s)
    except Exception as e:
        fails+=1
        if fails<3: print("fail at", i, e, time.time()-t)
print("opened", len(conns), "in", time.time()-t)
t=time.time()
s=socket.create_connection(addr, timeout=5); s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); print(s.recv(100)[:20], time.time()-t)
