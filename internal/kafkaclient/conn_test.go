package kafkaclient

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
)

// request returns a request frame of the given API key with n body bytes
// after the key: a 4-byte size, then the key.
func request(key int16, n int) []byte {
	b := make([]byte, 6+n)
	binary.BigEndian.PutUint32(b, uint32(2+n))
	binary.BigEndian.PutUint16(b[4:], uint16(key))
	return b
}

// The connection must name the request a broker hung up on, however sarama's
// writes split or join requests, and explain nothing once it lost track.
func TestConnFollowsRequests(t *testing.T) {
	sasl := request(apiKeySASLAuthenticate, 20)
	versions := request(apiKeyAPIVersions, 10)
	for _, tc := range []struct {
		name     string
		writes   [][]byte
		last     int32
		requests int32
	}{
		{"one write per request", [][]byte{versions, sasl}, apiKeySASLAuthenticate, 2},
		{"two requests in one write", [][]byte{append(append([]byte{}, versions...), sasl...)}, apiKeySASLAuthenticate, 2},
		{"a request split after its key", [][]byte{versions, sasl[:7], sasl[7:]}, apiKeySASLAuthenticate, 2},
		{"a body that looks like a header", [][]byte{request(3, 6)[:6], request(apiKeySASLAuthenticate, 0)}, 3, 1},
		{"header split: tracking stops", [][]byte{versions, sasl[:3], sasl[3:]}, -1, 1},
		{"negative size: tracking stops", [][]byte{{0xff, 0xff, 0xff, 0xff, 0, 36}}, -1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &conn{d: &dialer{}}
			c.first.Store(-1)
			c.last.Store(-1)
			for _, w := range tc.writes {
				c.follow(w)
			}
			if got := c.last.Load(); got != tc.last {
				t.Errorf("last API key = %d, want %d", got, tc.last)
			}
			if got := c.requests.Load(); got != tc.requests {
				t.Errorf("requests = %d, want %d", got, tc.requests)
			}
		})
	}
}

// explain must only reword errors of a broker hanging up, and only when the
// step says what went wrong; anything else comes back unchanged.
func TestConnExplain(t *testing.T) {
	saslDialer := &dialer{mech: "SCRAM-SHA-512", user: "u"}
	for _, tc := range []struct {
		name     string
		d        *dialer
		writes   [][]byte
		answered bool
		err      error
		want     string // substring; "" means unchanged
	}{
		{"hang-up during SASL", saslDialer, [][]byte{request(apiKeyAPIVersions, 1), request(apiKeySASLAuthenticate, 1)}, true, io.EOF,
			`SASL SCRAM-SHA-512 authentication as user "u" failed`},
		{"reset during SASL handshake", saslDialer, [][]byte{request(apiKeySASLHandshake, 1)}, true, &net.OpError{Op: "read", Err: syscall.ECONNRESET},
			"authentication"},
		{"hang-up after SASL, on a produce", saslDialer, [][]byte{request(apiKeySASLAuthenticate, 1), request(0, 1)}, true, io.EOF, ""},
		{"timeout during SASL", saslDialer, [][]byte{request(apiKeySASLAuthenticate, 1)}, false, errors.New("i/o timeout"), ""},
		{"plaintext, first request unanswered", &dialer{}, [][]byte{request(apiKeyAPIVersions, 1)}, false, io.EOF, "does its listener expect TLS?"},
		{"plaintext, hang-up later", &dialer{}, [][]byte{request(apiKeyAPIVersions, 1), request(3, 1), request(0, 1)}, true, io.EOF, ""},
		{"no SASL, hang-up after ApiVersions", &dialer{}, [][]byte{request(apiKeyAPIVersions, 1), request(3, 1)}, true, io.EOF,
			"does it require SASL authentication?"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &conn{d: tc.d, addr: "b:9092"}
			c.first.Store(-1)
			c.last.Store(-1)
			for _, w := range tc.writes {
				c.follow(w)
			}
			got := tc.err
			if closedByPeer(tc.err) {
				got = c.explain(tc.err, tc.answered)
			}
			if tc.want == "" {
				if got != tc.err {
					t.Fatalf("error reworded to %q, want %q unchanged", got, tc.err)
				}
				return
			}
			if !strings.Contains(got.Error(), tc.want) || !strings.Contains(got.Error(), "b:9092") {
				t.Errorf("error %q does not contain %q and the broker address", got, tc.want)
			}
			if !errors.Is(got, tc.err) {
				t.Errorf("error %q does not wrap %q", got, tc.err)
			}
		})
	}
}
