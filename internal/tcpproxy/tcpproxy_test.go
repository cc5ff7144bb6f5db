package tcpproxy

import (
	"bufio"
	"errors"
	"net"
	"os"
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

// roundTrip sends a line on c and reports whether it came back within 2 s.
func roundTrip(t *testing.T, c net.Conn) bool {
	t.Helper()
	return roundTripWithin(t, c, 2*time.Second)
}

func roundTripWithin(t *testing.T, c net.Conn, d time.Duration) bool {
	t.Helper()
	c.SetDeadline(time.Now().Add(d))
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

// gates are the two ways to put a Gate in front of a server.
var gates = []struct {
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
}

// open starts tc's server and returns its address, its gate and a
// connection that echoes.
func open(t *testing.T, addr func(t *testing.T) (string, *Gate)) (string, *Gate, net.Conn) {
	t.Helper()
	a, g := addr(t)
	c := dial(t, a)
	if !roundTrip(t, c) {
		t.Fatal("no echo through an open gate")
	}
	return a, g, c
}

func TestGate(t *testing.T) {
	for _, tc := range gates {
		t.Run(tc.name, func(t *testing.T) {
			addr, g, before := open(t, tc.addr)
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

// A stalled gate keeps its connections open and delivers nothing until
// Restore, then delivers what it held back; Cut ends a stall.
func TestGateStall(t *testing.T) {
	for _, tc := range gates {
		t.Run(tc.name, func(t *testing.T) {
			addr, g, before := open(t, tc.addr)
			g.Stall()
			if roundTripWithin(t, before, 300*time.Millisecond) {
				t.Error("a connection made before Stall echoes while stalled")
			}
			during := dial(t, addr)
			if roundTripWithin(t, during, 300*time.Millisecond) {
				t.Error("a connection made while stalled echoes")
			}
			g.Restore()
			for name, c := range map[string]net.Conn{"before": before, "during": during} {
				c.SetDeadline(time.Now().Add(2 * time.Second))
				if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || line != "ping\n" {
					t.Errorf("connection made %s the stall: after Restore read %q, %v; want the held-back echo", name, line, err)
				}
			}
			if !roundTrip(t, dial(t, addr)) {
				t.Error("no echo after Restore")
			}

			g.Stall()
			c := dial(t, addr)
			if _, err := c.Write([]byte("ping\n")); err != nil {
				t.Fatal(err)
			}
			g.Cut()
			c.SetDeadline(time.Now().Add(2 * time.Second))
			if _, err := bufio.NewReader(c).ReadString('\n'); err == nil {
				t.Error("a stalled connection still echoes after Cut")
			} else if errors.Is(err, os.ErrDeadlineExceeded) {
				t.Error("a stalled connection stays open after Cut")
			}
			g.Restore()
			if !roundTrip(t, dial(t, addr)) {
				t.Error("no echo after Cut and Restore")
			}
		})
	}
}
