package tcpproxy

import (
	"bufio"
	"net"
	"testing"
	"time"
)

// echo starts a line echo server through listen and returns its address.
func echo(t *testing.T, listen func(network, address string) (net.Listener, error)) string {
	t.Helper()
	l, err := listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return l.Addr().String()
}

// roundTrip dials addr, sends a line and reports whether it came back.
func roundTrip(t *testing.T, c net.Conn) bool {
	t.Helper()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return false
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return err == nil && line == "ping\n"
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestGate(t *testing.T) {
	for _, tc := range []struct {
		name string
		// addr returns the address to dial and the gate in front of it.
		addr func(t *testing.T) (string, *Gate)
	}{
		{"listener", func(t *testing.T) (string, *Gate) {
			g := &Gate{}
			return echo(t, g.Listen), g
		}},
		{"proxy", func(t *testing.T) (string, *Gate) {
			p, err := NewProxy(echo(t, net.Listen))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			return p.Addr(), p.Gate
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, g := tc.addr(t)
			before := dial(t, addr)
			if !roundTrip(t, before) {
				t.Fatal("no echo through an open gate")
			}
			g.Cut()
			if roundTrip(t, before) {
				t.Error("a connection made before Cut still works after it")
			}
			if roundTrip(t, dial(t, addr)) {
				t.Error("a connection made while cut works")
			}
			g.Restore()
			if !roundTrip(t, dial(t, addr)) {
				t.Error("no echo after Restore")
			}
		})
	}
}
