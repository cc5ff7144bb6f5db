package kafkaclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
)

// Kafka API keys the connection watches for (see the protocol's request
// header).
const (
	apiKeySASLHandshake    = 17
	apiKeyAPIVersions      = 18
	apiKeySASLAuthenticate = 36
)

// dialer opens the connections of every sarama client built by
// Settings.Config: TCP, then the TLS handshake when TLS is on, then a
// wrapper that names what the broker refused when it hangs up early.
//
// It takes TLS over from sarama (whose Net.TLS stays disabled) for two
// reasons. Errors: some brokers, among them kfake and Kafka before 1.0, drop
// the connection on bad credentials instead of answering
// SASL_AUTHENTICATION_FAILED, and a plaintext client at a TLS listener just
// sees the connection closed; sarama reports both as a bare "EOF". Telling
// which step failed needs the request stream in clear, above TLS. Bounds: the
// handshake here is part of the dial, so one Net.DialTimeout covers TCP and
// TLS together, and a TLS client at a plaintext listener fails within it.
//
// Sarama uses the same dialer to resolve names only with
// Net.ResolveCanonicalBootstrapServers, which Config leaves off.
type dialer struct {
	// conf is the configuration the dialer is installed in. Timeouts are read
	// from it at each dial, so that a caller that shortens Net.DialTimeout
	// after Config (the readiness probe does) shortens the handshake too.
	conf *sarama.Config
	tls  *tls.Config // nil: plaintext
	ca   string      // where trusted CAs come from, for errors
	mech string      // SASL mechanism, "" for none
	user string
}

// Dial connects to the broker at addr; sarama calls it through
// Net.Proxy.Dialer.
func (d *dialer) Dial(network, addr string) (net.Conn, error) {
	timeout := d.conf.Net.DialTimeout
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	nd := &net.Dialer{KeepAlive: d.conf.Net.KeepAlive, LocalAddr: d.conf.Net.LocalAddr}
	raw, err := nd.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err // net errors name the address already
	}
	c := raw
	if d.tls != nil {
		tc := tls.Client(raw, serverName(addr, d.tls))
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, d.handshakeError(addr, timeout, err)
		}
		c = tc
	}
	w := &conn{Conn: c, d: d, addr: addr}
	w.first.Store(-1)
	w.last.Store(-1)
	return w, nil
}

// serverName returns c with ServerName set to addr's host when it has none,
// as sarama does for its own TLS: the certificate is checked against the
// address dialed (an IP address is matched against the IP SANs).
func serverName(addr string, c *tls.Config) *tls.Config {
	if c.ServerName != "" {
		return c
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		host = addr
	}
	c = c.Clone()
	c.ServerName = host
	return c
}

func (d *dialer) handshakeError(addr string, timeout time.Duration, err error) error {
	var (
		ne      net.Error
		unknown x509.UnknownAuthorityError
	)
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout():
		return fmt.Errorf("TLS handshake with %s: no answer within %v (is the listener plaintext?): %w", addr, timeout, err)
	case closedByPeer(err):
		return fmt.Errorf("TLS handshake with %s: the broker closed the connection (is the listener plaintext?): %w", addr, err)
	case errors.As(err, &unknown):
		return fmt.Errorf("TLS handshake with %s: the broker's certificate is not signed by a CA trusted by %s: %w", addr, d.ca, err)
	default:
		return fmt.Errorf("TLS handshake with %s: %w", addr, err)
	}
}

// closedByPeer reports whether err says the other end closed the connection.
func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// conn follows the requests written to a broker connection, so that when the
// broker closes it, the read error can say during which step.
type conn struct {
	net.Conn
	d    *dialer
	addr string

	// Write side. Sarama writes whole requests, one per Write; the framing
	// is followed anyway (size prefix, then the API key) so that a split or
	// merged write cannot misname a request. Writes are serialized by
	// sarama; mu only keeps the race detector and future callers honest.
	mu   sync.Mutex
	rest int  // bytes of the current request still to come
	lost bool // framing no longer known: explain nothing

	first    atomic.Int32 // API key of the first request, -1 none or unknown
	last     atomic.Int32 // API key of the last request started, -1 none or unknown
	requests atomic.Int32 // requests started
	answered atomic.Bool  // the broker has sent at least one byte
}

func (c *conn) Write(p []byte) (int, error) {
	c.follow(p)
	return c.Conn.Write(p)
}

// follow notes the API key of every request that starts in p.
func (c *conn) follow(p []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for !c.lost && len(p) > 0 {
		if c.rest == 0 {
			if len(p) < 6 { // size and API key not in one write
				c.lost = true
				c.last.Store(-1)
				return
			}
			size := int32(binary.BigEndian.Uint32(p))
			if size < 2 {
				c.lost = true
				c.last.Store(-1)
				return
			}
			c.rest = 4 + int(size)
			key := int32(int16(binary.BigEndian.Uint16(p[4:])))
			c.last.Store(key)
			if c.requests.Add(1) == 1 {
				c.first.Store(key)
			}
		}
		n := min(c.rest, len(p))
		c.rest -= n
		p = p[n:]
	}
}

func (c *conn) Read(p []byte) (int, error) {
	answered := c.answered.Load()
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.answered.Store(true)
	}
	if err != nil && closedByPeer(err) {
		err = c.explain(err, answered)
	}
	return n, err
}

// explain returns err with what the broker most likely refused, when the
// step it hung up in says so, or err unchanged.
func (c *conn) explain(err error, answered bool) error {
	last := c.last.Load()
	switch {
	case c.d.mech != "" && (last == apiKeySASLHandshake || last == apiKeySASLAuthenticate):
		// Brokers that answer SASL_AUTHENTICATION_FAILED never get here:
		// sarama reports that answer itself.
		return fmt.Errorf("SASL %s authentication as user %q failed: broker %s closed the connection during authentication (wrong user or password, or mechanism not enabled for the user): %w",
			c.d.mech, c.d.user, c.addr, err)
	case c.d.tls == nil && !answered && c.requests.Load() == 1:
		// Nothing has been said on this connection yet, so it is no idle
		// timeout: the broker did not understand the very first request.
		return fmt.Errorf("broker %s closed the connection without answering the first request (does its listener expect TLS?): %w", c.addr, err)
	case c.d.mech == "" && answered && c.requests.Load() == 2 && c.first.Load() == apiKeyAPIVersions:
		// A broker that requires SASL answers ApiVersions before
		// authentication, then hangs up on the next request.
		return fmt.Errorf("broker %s closed the connection after answering only ApiVersions (does it require SASL authentication?): %w", c.addr, err)
	default:
		return err
	}
}
