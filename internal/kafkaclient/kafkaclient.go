// Package kafkaclient builds sarama configurations from the service's Kafka
// settings: protocol version, client id, TLS and SASL. Ingest and dispatch
// add their own consumer and producer settings on top.
package kafkaclient

import (
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"time"

	"github.com/IBM/sarama"
	"github.com/xdg-go/scram"
)

// Settings are the connection settings shared by every Kafka client of the
// service.
type Settings struct {
	Version  string // Kafka protocol version to speak, e.g. "3.6.0"
	ClientID string
	// Timeout bounds each network step (dial, write, read). Producers derive
	// the broker's ack timeout from it, and leases must outlast the publish
	// time it implies (see batchproducer.MaxDuration).
	Timeout time.Duration

	TLS                bool
	TLSCAFile          string // PEM; empty: the system roots
	TLSCertFile        string // PEM client certificate, with TLSKeyFile
	TLSKeyFile         string
	TLSInsecureSkipVer bool

	SASLMechanism string // "", PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
	SASLUser      string
	SASLPassword  string
}

// SASLMechanisms returns the mechanisms accepted in Settings.SASLMechanism.
func SASLMechanisms() []string { return []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} }

// Config returns a sarama configuration for s. The errors name the setting at
// fault.
//
// Connections are opened by the configuration's Net.Proxy.Dialer, which does
// the TLS handshake when s.TLS is set (Net.TLS stays disabled): callers must
// not replace it, and may shorten Net.DialTimeout, which bounds TCP and TLS
// together.
func (s Settings) Config() (*sarama.Config, error) {
	c := sarama.NewConfig()
	v, err := sarama.ParseKafkaVersion(s.Version)
	if err != nil {
		return nil, fmt.Errorf("kafka version %q: %w", s.Version, err)
	}
	c.Version = v
	if s.ClientID != "" {
		c.ClientID = s.ClientID
	}
	if s.Timeout > 0 {
		c.Net.DialTimeout, c.Net.ReadTimeout, c.Net.WriteTimeout = s.Timeout, s.Timeout, s.Timeout
	}
	// The dialer does TLS itself, so that it can tell a refused handshake or
	// credential from a dropped connection (see dialer); Net.TLS stays off.
	d := &dialer{conf: c, mech: s.SASLMechanism, user: s.SASLUser}
	if s.TLS {
		tc, err := s.tlsConfig()
		if err != nil {
			return nil, err
		}
		d.tls, d.ca = tc, "the system roots"
		if s.TLSCAFile != "" {
			d.ca = s.TLSCAFile
		}
	}
	c.Net.Proxy.Enable = true
	c.Net.Proxy.Dialer = d
	switch s.SASLMechanism {
	case "":
	case "PLAIN":
		c.Net.SASL.Enable = true
		c.Net.SASL.Mechanism = sarama.SASLTypePlaintext
	case "SCRAM-SHA-256":
		c.Net.SASL.Enable = true
		c.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA256
		c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.HashGeneratorFcn(sha256.New)} }
	case "SCRAM-SHA-512":
		c.Net.SASL.Enable = true
		c.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
		c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.HashGeneratorFcn(sha512.New)} }
	default:
		return nil, fmt.Errorf("SASL mechanism %q: want one of %v", s.SASLMechanism, SASLMechanisms())
	}
	if c.Net.SASL.Enable {
		if s.SASLUser == "" {
			return nil, fmt.Errorf("SASL mechanism %s needs a user", s.SASLMechanism)
		}
		c.Net.SASL.User = s.SASLUser
		c.Net.SASL.Password = s.SASLPassword
		c.Net.SASL.Handshake = true
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("kafka settings: %w", err)
	}
	return c, nil
}

func (s Settings) tlsConfig() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: s.TLSInsecureSkipVer} //nolint:gosec // opt-in, documented
	if s.TLSCAFile != "" {
		pem, err := os.ReadFile(s.TLSCAFile)
		if err != nil {
			return nil, fmt.Errorf("TLS CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("TLS CA file %s: no PEM certificate found", s.TLSCAFile)
		}
		tc.RootCAs = pool
	}
	if (s.TLSCertFile == "") != (s.TLSKeyFile == "") {
		return nil, fmt.Errorf("TLS client certificate and key must be set together (cert %q, key %q)", s.TLSCertFile, s.TLSKeyFile)
	}
	if s.TLSCertFile != "" {
		cert, err := tls.LoadX509KeyPair(s.TLSCertFile, s.TLSKeyFile)
		if err != nil {
			return nil, fmt.Errorf("TLS client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// scramClient adapts xdg-go/scram to sarama.SCRAMClient.
type scramClient struct {
	hash scram.HashGeneratorFcn
	conv *scram.ClientConversation
}

func (x *scramClient) Begin(user, password, authzID string) error {
	c, err := x.hash.NewClient(user, password, authzID)
	if err != nil {
		return fmt.Errorf("SCRAM client: %w", err)
	}
	x.conv = c.NewConversation()
	return nil
}

func (x *scramClient) Step(challenge string) (string, error) { return x.conv.Step(challenge) }

func (x *scramClient) Done() bool { return x.conv.Done() }
