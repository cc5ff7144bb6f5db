// Package tcpproxy cuts TCP connections on demand, for tests of how the
// scheduler degrades when Postgres or Kafka goes away. A Gate tracks the
// connections made through it: Cut closes them all and turns new ones away
// (accepted, then closed at once, as a server that is going down does) until
// Restore. Stall keeps them open but lets nothing through, as a server that
// hangs or a network that drops packets does: a client waits for its own
// timeouts. A Gate wraps a listener (for servers that take a listen function,
// like kfake, which then advertise the gated address themselves) or forwards
// to an address (Proxy, for servers that cannot be given a listener, like
// Postgres).
package tcpproxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// Gate cuts and restores the connections of the listeners and proxies made
// from it. The zero value is open and ready to use; it is safe for concurrent
// use.
type Gate struct {
	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
	cuts  int
	// stalled is nil while the gate lets data through; while it is
	// stalled, it is a channel that Restore or Cut closes.
	stalled chan struct{}
}

// Stall stops the data of every connection made through the gate, those
// open and those to come, without closing any, until Restore: what was read
// from one side is held back, not delivered.
func (g *Gate) Stall() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stalled == nil {
		g.stalled = make(chan struct{})
	}
}

// wait returns once the gate is not stalled, or when done is closed.
func (g *Gate) wait(done <-chan struct{}) {
	g.mu.Lock()
	ch := g.stalled
	g.mu.Unlock()
	if ch == nil {
		return
	}
	select {
	case <-ch:
	case <-done:
	}
}

// Cut closes every connection made through the gate and makes new ones close
// as soon as they are accepted, until Restore. It ends a stall: what was
// held back goes to connections that are closed.
func (g *Gate) Cut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.cut = true
	g.cuts++
	for c := range g.conns {
		c.Close()
	}
	clear(g.conns)
	g.unstall()
}

// unstall lets held-back data go; g.mu must be held.
func (g *Gate) unstall() {
	if g.stalled != nil {
		close(g.stalled)
		g.stalled = nil
	}
}

// Restore lets connections and their data through again.
func (g *Gate) Restore() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.cut = false
	g.unstall()
}

// admit tracks cs and reports true, or closes them and reports false when the
// gate is cut.
func (g *Gate) admit(cs ...net.Conn) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.cut {
		for _, c := range cs {
			c.Close()
		}
		return false
	}
	if g.conns == nil {
		g.conns = map[net.Conn]struct{}{}
	}
	for _, c := range cs {
		g.conns[c] = struct{}{}
	}
	return true
}

func (g *Gate) forget(cs ...net.Conn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, c := range cs {
		delete(g.conns, c)
	}
}

// Listen listens on network and address like net.Listen, through the gate.
// Its signature fits kfake.ListenFn.
func (g *Gate) Listen(network, address string) (net.Listener, error) {
	l, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	return &listener{Listener: l, g: g}, nil
}

type listener struct {
	net.Listener
	g *Gate
}

// Accept returns the next connection the gate lets through. Connections
// arriving while the gate is cut are closed and never returned: an error from
// Accept would make most servers stop listening for good.
func (l *listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.g.admit(c) {
			return &conn{Conn: c, g: l.g, closed: make(chan struct{})}, nil
		}
	}
}

type conn struct {
	net.Conn
	g      *Gate
	once   sync.Once
	closed chan struct{}
}

// Read holds back what it read while the gate is stalled: the server behind
// the listener sees nothing of what its clients send, and so answers
// nothing.
func (c *conn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.g.wait(c.closed)
	return n, err
}

func (c *conn) Close() error {
	c.once.Do(func() {
		c.g.forget(c.Conn)
		close(c.closed)
	})
	return c.Conn.Close()
}

// Proxy forwards connections from a local address to a target through a
// Gate.
type Proxy struct {
	// Gate cuts and restores the proxied connections.
	Gate   *Gate
	l      net.Listener
	target string
	wg     sync.WaitGroup
}

// NewProxy listens on a free port of 127.0.0.1 and forwards each connection
// to target.
func NewProxy(target string) (*Proxy, error) {
	p := &Proxy{Gate: &Gate{}, target: target}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy to %s: %w", target, err)
	}
	p.l = l
	p.wg.Go(p.serve)
	return p, nil
}

// Addr returns the address the proxy listens on.
func (p *Proxy) Addr() string { return p.l.Addr().String() }

// Close stops listening, closes every proxied connection and waits for the
// forwarding goroutines.
func (p *Proxy) Close() error {
	err := p.l.Close()
	p.Gate.Cut()
	p.wg.Wait()
	return err
}

func (p *Proxy) serve() {
	for {
		in, err := p.l.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			continue
		}
		if !p.Gate.admit(in) {
			continue
		}
		p.wg.Go(func() { p.forward(in) })
	}
}

func (p *Proxy) forward(in net.Conn) {
	defer p.Gate.forget(in)
	defer in.Close()
	out, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	if !p.Gate.admit(out) {
		return
	}
	defer p.Gate.forget(out)
	defer out.Close()
	done := make(chan struct{}, 2)
	ended := make(chan struct{})
	copyHalf := func(dst, src net.Conn) {
		io.Copy(dst, &stallReader{src: src, g: p.Gate, done: ended})
		// Either side ending ends both: half-open connections would keep a
		// cut client waiting for a read timeout.
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go copyHalf(out, in)
	go copyHalf(in, out)
	<-done
	close(ended)
	<-done
}

// stallReader holds back what it read from src while its gate is stalled,
// until done is closed (the other direction of the connection ended).
type stallReader struct {
	src  net.Conn
	g    *Gate
	done <-chan struct{}
}

func (r *stallReader) Read(b []byte) (int, error) {
	n, err := r.src.Read(b)
	r.g.wait(r.done)
	return n, err
}
